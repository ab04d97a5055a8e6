"""PercentileObserver: exact nearest-rank percentiles per batch, averaged over batches."""

import numpy as np
import pytest
import torch

from qfuse.errors import UnsupportedError
from qfuse.observers import MinMaxObserver, PercentileObserver
from qfuse.observers.percentile import kth_rank
from tests.observers.parity import CHANNEL_AXIS, KINDS, make_batches

schemes = pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])


def reference_range(batches, percentile, symmetric, per_channel):
    """numpy's inverted-CDF percentiles per batch (and channel), averaged in float64."""
    lows, highs = [], []
    for x in batches:
        a = x.movedim(CHANNEL_AXIS, 0).reshape(x.shape[CHANNEL_AXIS], -1).double().numpy()
        if not per_channel:
            a = a.reshape(1, -1)
        if symmetric:
            hi = np.percentile(np.abs(a), percentile, axis=1, method="inverted_cdf")
            lo = -hi
        else:
            hi = np.percentile(a, percentile, axis=1, method="inverted_cdf")
            lo = np.percentile(a, 100 - percentile, axis=1, method="inverted_cdf")
        lows.append(lo)
        highs.append(hi)
    lo, hi = np.mean(lows, axis=0), np.mean(highs, axis=0)
    if not per_channel:
        lo, hi = lo[0], hi[0]
    return torch.tensor(lo).float(), torch.tensor(hi).float()


@schemes
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("percentile", [99.9, 99.0, 90.0])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy_inverted_cdf_percentiles(kind, percentile, per_channel, symmetric):
    batches = make_batches(kind)
    obs = PercentileObserver(
        percentile=percentile,
        symmetric=symmetric,
        channel_axis=CHANNEL_AXIS if per_channel else None,
    )
    for x in batches:
        obs(x)
    lo, hi = obs.value_range()
    ref_lo, ref_hi = reference_range(batches, percentile, symmetric, per_channel)
    torch.testing.assert_close(lo, ref_lo, rtol=0, atol=0)
    torch.testing.assert_close(hi, ref_hi, rtol=0, atol=0)


def test_percentile_100_is_the_mean_of_batch_extremes():
    obs = PercentileObserver(percentile=100.0, symmetric=False)
    obs(torch.tensor([-1.0, 0.5, 3.0]))
    obs(torch.tensor([-3.0, 0.0, 1.0]))
    assert obs.value_range() == (torch.tensor(-2.0), torch.tensor(2.0))


@pytest.mark.parametrize(
    "percentile, n, rank",
    [(99.99, 10_000, 9999), (99.99, 9_999, 9999), (99.9, 1000, 999), (50, 5, 3), (1e-9, 7, 1)],
)
def test_kth_rank_is_exact_at_float_boundaries(percentile, n, rank):
    # In floats 99.99 / 100 * 10_000 is 9999.000000000002 and 99.9 is 99.900000000000006:
    # a float ceil would pick the maximum in both.
    assert kth_rank(percentile, n) == rank


@schemes
def test_clips_outliers_that_minmax_keeps(symmetric):
    batches = make_batches("outliers")
    pct, mm = (
        PercentileObserver(percentile=99.5, symmetric=symmetric),  # 11 of 2304 clipped
        MinMaxObserver(symmetric=symmetric),
    )
    for x in batches:
        pct(x)
        mm(x)
    assert pct.calculate_qparams()[0] < 0.3 * mm.calculate_qparams()[0]


def test_result_is_deterministic_and_independent_of_batch_order():
    batches = make_batches("outliers")
    runs = []
    for order in (batches, batches, batches[::-1]):
        obs = PercentileObserver(symmetric=False, channel_axis=CHANNEL_AXIS)
        for x in order:
            obs(x)
        runs.append(obs.calculate_qparams())
    for scale, zp in runs[1:]:
        assert torch.equal(scale, runs[0][0]) and torch.equal(zp, runs[0][1])


@pytest.mark.parametrize("percentile", [0.0, -1.0, 100.5])
def test_percentile_outside_0_100_is_refused(percentile):
    with pytest.raises(UnsupportedError, match=r"head: percentile=.*outside \(0, 100\]"):
        PercentileObserver(percentile=percentile, layer_name="head")
