"""MovingAverageMinMaxObserver against torch.ao's moving-average observers, bit for bit."""

import pytest
import torch
from torch.ao import quantization as tq

from qfuse.errors import UnsupportedError
from qfuse.observers import MovingAverageMinMaxObserver
from tests.observers.parity import (
    CHANNEL_AXIS,
    KINDS,
    assert_same_qparams,
    make_batches,
    torch_ao_args,
)

schemes = pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])


@schemes
@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_per_tensor_matches_torch_ao(kind, c, symmetric):
    ours = MovingAverageMinMaxObserver(averaging_constant=c, symmetric=symmetric)
    ref = tq.MovingAverageMinMaxObserver(averaging_constant=c, **torch_ao_args(symmetric))
    for x in make_batches(kind):
        ours(x)
        ref(x)
        assert_same_qparams(ours.calculate_qparams(), ref.calculate_qparams())


@schemes
@pytest.mark.parametrize("kind", KINDS)
def test_per_channel_matches_torch_ao(kind, symmetric):
    ours = MovingAverageMinMaxObserver(
        averaging_constant=0.2, symmetric=symmetric, channel_axis=CHANNEL_AXIS
    )
    ref = tq.MovingAveragePerChannelMinMaxObserver(
        averaging_constant=0.2, ch_axis=CHANNEL_AXIS, **torch_ao_args(symmetric, per_channel=True)
    )
    for x in make_batches(kind):
        ours(x)
        ref(x)
        assert_same_qparams(ours.calculate_qparams(), ref.calculate_qparams())


def test_first_batch_sets_the_range_and_later_ones_move_it_by_c():
    obs = MovingAverageMinMaxObserver(averaging_constant=0.25, symmetric=False)
    obs(torch.tensor([-2.0, 4.0]))
    assert obs.value_range() == (torch.tensor(-2.0), torch.tensor(4.0))
    obs(torch.tensor([-10.0, 0.0]))  # min: -2 + 0.25 * (-8) = -4; max: 4 + 0.25 * (-4) = 3
    assert obs.value_range() == (torch.tensor(-4.0), torch.tensor(3.0))


def test_one_outlier_batch_moves_the_range_by_c_of_its_excess():
    obs = MovingAverageMinMaxObserver()  # c = 0.01
    for _ in range(5):
        obs(torch.tensor([-1.0, 1.0]))
    obs(torch.tensor([-1.0, 101.0]))
    torch.testing.assert_close(obs.value_range()[1], torch.tensor(2.0))


@pytest.mark.parametrize("c", [0.0, -0.1, 1.5])
def test_averaging_constant_outside_0_1_is_refused(c):
    with pytest.raises(UnsupportedError, match=r"blocks\.0\.attn: averaging_constant=.*\(0, 1\]"):
        MovingAverageMinMaxObserver(averaging_constant=c, layer_name="blocks.0.attn")
