"""Compile converted models in-process (one compile thread) and print the real traceback of any
failure: Inductor's worker processes report only 'SubprocException'.

    python -m bench.diag.diag_compile      # GPU
"""

import traceback

import torch
import torch._inductor.config as ic

import qfuse
from tests.models import LNBlock, MLPBlock


def main() -> None:
    ic.compile_threads = 1
    for name, model, d in (("mlp", MLPBlock(), 32), ("ln", LNBlock(), 64)):
        for cfg in ("int8_static", "fp8_static"):
            x = torch.randn(4, 8, d)
            p = qfuse.prepare(model.eval(), getattr(qfuse.QConfig, cfg)(), (x,))
            p(x)
            q = qfuse.convert(p).cuda()
            x = x.cuda()
            torch._dynamo.reset()
            try:
                out = torch.compile(q, fullgraph=True)(x)
                ref = q(x)
                print(name, cfg, "OK equal:", torch.equal(out, ref),
                      "maxdiff", (out.float() - ref.float()).abs().max().item(), flush=True)
            except Exception:
                print(name, cfg, "FAILED")
                print("\n".join(traceback.format_exc().splitlines()[-40:]), flush=True)


if __name__ == "__main__":
    main()
