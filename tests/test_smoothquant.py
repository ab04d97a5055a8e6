import copy

import pytest
import torch

import qfuse
from qfuse.smoothquant import factors
from tests.models import LNBlock, sqnr_db


def quantize(model, x, **kw):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), **kw)
    with torch.no_grad():
        prepared(x)
    return qfuse.convert(prepared)


def test_smoothquant_improves_accuracy_on_outlier_channels():
    torch.manual_seed(0)
    model = LNBlock().eval()
    x = torch.randn(64, 64)
    plain = quantize(model, x)
    smooth = quantize(model, x, smoothquant=qfuse.SmoothQuant(alpha=0.5))
    with torch.no_grad():
        ref = model(x)
        gain = sqnr_db(ref, smooth(x)) - sqnr_db(ref, plain(x))
    assert gain > 6.0
    notes = {r["name"]: r["note"] for r in qfuse.summary(smooth).rows}
    assert notes["fc"] == "SmoothQuant alpha=0.5 (prologue)"
    assert notes["fc2"] == "SmoothQuant alpha=0.5 (folded into producer)"
    assert smooth.get_submodule("fc").x_inv_scale.shape == (64,)


def test_prologue_vector_runs_identically_in_triton(device):
    torch.manual_seed(1)
    model = LNBlock().eval()
    x = torch.randn(16, 64)
    qmodel = quantize(model, x, smoothquant=qfuse.SmoothQuant(alpha=0.5, layers=("fc",)))
    fc = qmodel.get_submodule("fc")  # int8 out to fc2: compared exactly
    assert fc.x_inv_scale.shape == (64,) and fc.out_dtype == torch.int8
    with torch.no_grad():
        h = model.ln(x)  # the same float input on both sides (CUDA's LayerNorm rounds its own way)
        with qfuse.use_backend("reference"):
            ref = fc(h)
        with qfuse.use_backend("triton"):  # interpreter on CPU, else the GPU
            out = copy.deepcopy(fc).to(device)(h.to(device)).cpu()
    assert torch.equal(ref, out)


def test_factors_leave_dead_channels_alone():
    act = torch.tensor([4.0, 0.0, 1.0])
    w = torch.tensor([[1.0, 2.0, 0.0], [0.25, 1.0, 0.0]])
    s = factors(act, w, alpha=0.5)
    assert s.tolist() == pytest.approx([2.0, 1.0, 1.0])


def test_alpha_out_of_range_is_rejected():
    with pytest.raises(qfuse.UnsupportedError, match="alpha"):
        qfuse.SmoothQuant(alpha=1.5)
