"""Histogram observers: torch.ao parity of "histogram", and what the MSE/entropy searches choose."""

import pytest
import torch
from torch.ao import quantization as tq

from qfuse.observers import (
    HistogramEntropyObserver,
    HistogramMSEObserver,
    HistogramObserver,
    MinMaxObserver,
)
from qfuse.primitives import choose_qparams, fake_quantize
from tests.observers.parity import KINDS, assert_same_qparams, make_batches, torch_ao_args

schemes = pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
SEARCHES = [HistogramMSEObserver, HistogramEntropyObserver]


def assert_matches_torch_ao(ours, ref, batches):
    """Same histogram, range and qparams after every batch."""
    for x in batches:
        ours(x)
        ref(x)
        assert torch.equal(ours.histogram, ref.histogram)
        assert torch.equal(ours.min_val, ref.min_val) and torch.equal(ours.max_val, ref.max_val)
        assert_same_qparams(ours.calculate_qparams(), ref.calculate_qparams())


def one_outlier(value: float = 100.0, n: int = 2**19) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[123] = value
    return x


@schemes
@pytest.mark.parametrize("kind", KINDS)
def test_matches_torch_ao(kind, symmetric):
    assert_matches_torch_ao(
        HistogramObserver(symmetric=symmetric),
        tq.HistogramObserver(**torch_ao_args(symmetric)),
        make_batches(kind),
    )


@schemes
@pytest.mark.parametrize(
    "case",
    [
        "constant_first_batch",  # old range is one point: it is re-binned as a single spike
        "repeated_batch",  # range unchanged: histograms are added without re-binning
        "narrower_batch",  # range unchanged, new data strictly inside
        "growing_both_sides",
    ],
)
def test_matches_torch_ao_on_each_accumulation_path(case, symmetric):
    x = make_batches("gaussian")[0]
    batches = {
        "constant_first_batch": [torch.full((50,), 0.7), x],
        "repeated_batch": [x, x, x],
        "narrower_batch": [x, x * 0.5, x * 0.25],
        "growing_both_sides": [x * 0.1, x - 3.0, x + 5.0, x * 7.0],
    }[case]
    assert_matches_torch_ao(
        HistogramObserver(symmetric=symmetric),
        tq.HistogramObserver(**torch_ao_args(symmetric)),
        batches,
    )


def test_matches_torch_ao_with_other_bins_and_weight_range():
    # [-127, 127] (weights) still searches 2**8 levels, as torch.ao does for qint8.
    ours = HistogramObserver(bins=300, upsample_rate=4, qmin=-127, qmax=127)
    ref = tq.HistogramObserver(
        bins=300,
        dtype=torch.qint8,
        qscheme=torch.per_tensor_symmetric,
        quant_min=-127,
        quant_max=127,
    )
    ref.upsample_rate = 4  # a plain attribute in torch.ao, not a constructor argument
    assert_matches_torch_ao(ours, ref, make_batches("outliers"))


@schemes
def test_mse_integral_matches_measured_quantization_error(symmetric):
    # Evenly spaced data is uniform within every bin, which is what the integral assumes, so
    # the closed form must equal the squared error of actually fake-quantizing the data.
    x = torch.linspace(-3.0, 5.0, 2**20)
    obs = HistogramMSEObserver(bins=64, symmetric=symmetric)
    obs(x)
    lo = torch.tensor([-3.0, -1.5, -1.0, -0.2])
    hi = torch.tensor([5.0, 2.5, 2.0, 0.3])
    predicted = obs._expected_sq_error(lo, hi)
    for i in range(len(lo)):
        scale, zp = choose_qparams(lo[i], hi[i], symmetric=symmetric)
        measured = ((fake_quantize(x, scale, zp) - x).double() ** 2).sum()
        torch.testing.assert_close(predicted[i], measured, rtol=2e-3, atol=0)


@schemes
@pytest.mark.parametrize("cls", SEARCHES)
def test_searches_clip_a_heavy_outlier(cls, symmetric):
    # One value at 100 among 2**19 N(0, 1): minmax spends the int8 grid on it.
    x = one_outlier()
    obs, mm = cls(symmetric=symmetric), MinMaxObserver(symmetric=symmetric)
    obs(x)
    mm(x)
    limit = 0.65 if cls is HistogramMSEObserver else 0.3  # measured: MSE 0.27/0.59, KL 0.07/0.12
    assert obs.calculate_qparams()[0] < limit * mm.calculate_qparams()[0]


@schemes
def test_mse_range_has_the_least_measured_error(symmetric):
    x = one_outlier()
    errors = {}
    for cls in (HistogramMSEObserver, HistogramEntropyObserver, HistogramObserver, MinMaxObserver):
        obs = cls(symmetric=symmetric)
        obs(x)
        scale, zp = obs.calculate_qparams()
        errors[cls.__name__] = float(((fake_quantize(x, scale, zp) - x) ** 2).sum())
    assert min(errors, key=errors.get) == "HistogramMSEObserver", errors


@schemes
@pytest.mark.parametrize("cls", SEARCHES)
def test_searches_are_deterministic(cls, symmetric):
    batches = make_batches("outliers")
    runs = []
    for _ in range(2):
        obs = cls(symmetric=symmetric)
        for x in batches:
            obs(x)
        runs += [obs.calculate_qparams(), obs.calculate_qparams()]
    for scale, zp in runs[1:]:
        assert torch.equal(scale, runs[0][0]) and torch.equal(zp, runs[0][1])


@pytest.mark.parametrize("cls", SEARCHES)
def test_affine_search_clips_a_one_sided_outlier_only_on_its_side(cls):
    # Shrinking both ends together would have to clip the clean negative tail too.
    x = one_outlier(60.0)
    obs = cls(symmetric=False)
    obs(x)
    lo, hi = obs.value_range()
    assert lo < 0.75 * x.min() and hi < 0.75 * x.max()
    assert hi / x.max() < 0.75 * (lo / x.min())  # the outlier side is clipped far more
