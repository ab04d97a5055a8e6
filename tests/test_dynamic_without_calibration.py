"""``int8_dynamic()`` / ``fp8_dynamic()`` convert without calibration: per-token scales are
computed at run time, so nothing needs data, and the result equals the calibrated one bit for
bit. SmoothQuant and GPTQ do need data, and say so (``qfuse.flows.plan``)."""

import pytest
import torch

import qfuse
from qfuse.errors import CalibrationError
from tests.cnn_blocks import TinyResNet
from tests.models import MLPBlock, randomize_batchnorm, tiny_bert, token_batch


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _cases():
    torch.manual_seed(0)
    yield "mlp", MLPBlock().eval(), (torch.randn(4, 7, 32),), {}
    yield "cnn", randomize_batchnorm(TinyResNet()), (torch.randn(2, 3, 16, 16),), {}
    pytest.importorskip("transformers")
    yield "bert", tiny_bert(), (), token_batch()


@pytest.mark.parametrize("config", ["int8_dynamic", "fp8_dynamic"])
def test_dynamic_configs_convert_without_calibration(config):
    config = getattr(qfuse.QConfig, config)()
    for name, model, args, kwargs in _cases():
        bare = qfuse.prepare(model, config, args, kwargs)
        calibrated = qfuse.prepare(model, config, args, kwargs)
        with torch.no_grad():
            calibrated(*args, **kwargs)
            for output in ("graph", "model"):
                want = _first(qfuse.convert(calibrated, output=output)(*args, **kwargs))
                got = _first(qfuse.convert(bare, output=output)(*args, **kwargs))
                assert torch.equal(got, want), (name, output)


@pytest.mark.parametrize(("algorithm", "named"), [
    ({"smoothquant": qfuse.SmoothQuant(alpha=0.5, layers=("down",))}, "SmoothQuant"),
    ({"gptq": qfuse.GPTQ()}, "GPTQ"),
])
def test_what_needs_data_says_so(algorithm, named):
    torch.manual_seed(0)
    x = torch.randn(4, 7, 32)
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_dynamic(), (x,), **algorithm)
    with pytest.raises(CalibrationError, match=f"no calibration data .*{named}"):
        qfuse.convert(prepared)


def test_static_configs_still_need_calibration():
    x = torch.randn(4, 7, 32)
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (x,))
    with pytest.raises(CalibrationError, match="no calibration data reached this layer"):
        qfuse.convert(prepared)
