"""InputHessian: the running E[x x^T] GPTQ reads, for Linear rows and Conv2d patches."""

import pytest
import torch
import torch.nn.functional as F

from qfuse.errors import CalibrationError
from qfuse.observers.base import observers_disabled
from qfuse.observers.hessian import InputHessian


def test_running_mean_over_batches_equals_one_pass():
    torch.manual_seed(0)
    batches = [torch.randn(3, 5, 12), torch.randn(1, 7, 12), torch.randn(4, 1, 12)]
    h = InputHessian(layer_name="fc")
    for x in batches:
        assert h(x) is x  # identity
    rows = torch.cat([x.reshape(-1, 12) for x in batches]).double()
    expected = rows.T @ rows / rows.shape[0]
    torch.testing.assert_close(h.hessian.double(), expected, rtol=1e-5, atol=1e-6)
    assert int(h.num_rows) == rows.shape[0] and int(h.num_batches) == 3


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
        dict(kernel_size=(2, 3), stride=(2, 1), padding=(0, 2), dilation=(1, 2)),
    ],
)
def test_conv_rows_are_the_patches_the_weight_multiplies(conv):
    torch.manual_seed(1)
    x, w = torch.randn(2, 3, 9, 7), torch.randn(4, 3, *conv["kernel_size"])
    h = InputHessian(layer_name="conv", conv=conv)
    h(x)
    rows = h._rows(x)
    # The rows' order must match weight.reshape(out, -1): then rows @ W^T is the convolution.
    out = F.conv2d(x, w, **{k: v for k, v in conv.items() if k != "kernel_size"})
    torch.testing.assert_close(
        (rows @ w.reshape(4, -1).T).reshape(2, -1, 4), out.flatten(2).transpose(1, 2)
    )
    torch.testing.assert_close(h.hessian, rows.T @ rows / rows.shape[0], rtol=1e-5, atol=1e-5)


def test_disabled_records_nothing_and_new_data_clears_the_gptq_cache():
    h = InputHessian(layer_name="fc")
    with observers_disabled(torch.nn.Sequential(h)):
        h(torch.randn(4, 8))
    assert int(h.num_rows) == 0
    h(torch.randn(4, 8))
    h.solved["key"] = "stale"
    h(torch.randn(4, 8))
    assert h.solved == {}


def test_bad_batches_raise_naming_the_layer():
    h = InputHessian(layer_name="encoder.fc (input)")
    with pytest.raises(CalibrationError, match="encoder.fc"):
        h.check_calibrated()
    with pytest.raises(CalibrationError, match="NaN"):
        h(torch.tensor([[1.0, float("nan")]]))
    h(torch.randn(3, 8))
    with pytest.raises(CalibrationError, match="8"):
        h(torch.randn(3, 6))
    conv = InputHessian(layer_name="c", conv=dict(kernel_size=(1, 1)))
    with pytest.raises(CalibrationError, match="NCHW"):
        conv(torch.randn(3, 4))


def test_state_dict_loads_into_a_fresh_recorder():
    h = InputHessian(layer_name="fc")
    h(torch.randn(16, 6))
    fresh = InputHessian(layer_name="fc")
    fresh.load_state_dict(h.state_dict())
    assert torch.equal(fresh.hessian, h.hessian) and int(fresh.num_rows) == 16
