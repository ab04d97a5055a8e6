"""MinMaxObserver against torch.ao's MinMaxObserver and PerChannelMinMaxObserver, bit for bit."""

import pytest
from torch.ao import quantization as tq

from qfuse.observers import MinMaxObserver
from tests.observers.parity import (
    CHANNEL_AXIS,
    KINDS,
    assert_same_qparams,
    make_batches,
    torch_ao_args,
)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
@pytest.mark.parametrize("kind", KINDS)
def test_per_tensor_matches_torch_ao(kind, symmetric):
    ours = MinMaxObserver(symmetric=symmetric)
    ref = tq.MinMaxObserver(**torch_ao_args(symmetric))
    for x in make_batches(kind):
        ours(x)
        ref(x)
        assert_same_qparams(ours.calculate_qparams(), ref.calculate_qparams())


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
@pytest.mark.parametrize("kind", KINDS)
def test_per_channel_matches_torch_ao(kind, symmetric):
    ours = MinMaxObserver(symmetric=symmetric, channel_axis=CHANNEL_AXIS)
    ref = tq.PerChannelMinMaxObserver(ch_axis=CHANNEL_AXIS, **torch_ao_args(symmetric, True))
    for x in make_batches(kind):
        ours(x)
        ref(x)
    assert_same_qparams(ours.calculate_qparams(), ref.calculate_qparams())


def test_result_does_not_depend_on_batch_order():
    batches = make_batches("outliers")
    forward, backward = MinMaxObserver(), MinMaxObserver()
    for x in batches:
        forward(x)
    for x in reversed(batches):
        backward(x)
    assert_same_qparams(forward.calculate_qparams(), backward.calculate_qparams())
