import torch, qfuse, traceback
from torch import nn
import tests.test_bad_inputs_property as t
torch.manual_seed(0)
m = t.MLP().eval(); x = torch.randn(4, 3, 8)
p = qfuse.prepare(m, qfuse.QConfig.int8_static(), (x,)); p(x)
g = qfuse.convert(p); s = qfuse.convert(p, output="model")
for bad in [torch.randn(0,3,8).long(), torch.randn(4,3,8, device="meta"), torch.randn(8), torch.randn(()), torch.randn(2,8), torch.randn(0,3,8), torch.randn(4,3,8).half(), torch.randn(3), torch.randn(4,3,8).to(torch.complex64)]:
    for q in (g, s):
        try: y = q(bad); print("OK", tuple(bad.shape), bad.dtype, bad.device, type(q).__name__, tuple(y.shape))
        except qfuse.QFuseError as e: print("QE", type(e).__name__, str(e)[:120])
        except Exception as e: print("RAW", tuple(bad.shape), bad.dtype, type(q).__name__, traceback.format_exc()[-600:])
