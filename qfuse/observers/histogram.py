"""Histogram observers: one running histogram, three ways to choose the clipping range from it.

All three accumulate the histogram of torch.ao's ``HistogramObserver``: ``bins`` equal bins over
the running [min, max]; when a batch widens the range, the old histogram is re-binned onto the
new one (each old bin split into ``upsample_rate`` equal parts whose midpoints are re-bucketed).
They differ only in ``search_range``, which picks the clipped (min, max) the qparams cover:

- ``HistogramObserver`` ("histogram"): torch.ao's greedy L2 search, reproduced op for op, so the
  same batches give the same scale and zero point as ``torch.ao.quantization.HistogramObserver``.
- ``HistogramMSEObserver`` ("histogram_mse"): the candidate range with the smallest expected
  squared error of the actual quantizer (scale, zero point, rounding and clipping).
- ``HistogramEntropyObserver`` ("histogram_entropy"): TensorRT-style calibration, the candidate
  whose quantized distribution is closest to the clipped one in KL divergence.

Per-tensor only: one histogram per channel would cost ``bins`` floats per channel and a search
per channel, and per-channel ranges are almost always weights, where "minmax" is what you want.
"""

from __future__ import annotations

import struct

import torch

from qfuse.errors import UnsupportedError
from qfuse.observers.base import Observer
from qfuse.primitives import choose_qparams

# The MSE and entropy searches score about _COARSE evenly spaced candidate ranges, then refine
# around the best with _REFINE times finer steps down to one bin: at bins=2048, strides 64, 8, 1
# score ~63 ranges instead of all 2048, ~5 ms instead of ~140 ms per search on a 2-core CPU. On
# the MSE cost (smooth) it found the exhaustive optimum on every test distribution; on the KL
# cost (jagged: level/bin aliasing) it can settle on a neighbouring local minimum.
_COARSE = 32
_REFINE = 8
# KL smoothing: a clipped value whose quantization level holds no in-range data gets this many
# counts of probability in Q instead of 0 (MXNet's / ONNX Runtime's constant). Without it the
# divergence is infinite and an isolated outlier could never be clipped.
_KL_EPS = 1e-4


def _as_float32(v: float) -> float:
    """``v`` rounded to float32, as torch rounds a Python float compared with a float32 tensor."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _cube_integral(begin: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``(end^3 - begin^3) / 3``, the integral of t^2 over [begin, end] (torch.ao's _get_norm)."""
    return (end * end * end - begin * begin * begin) / 3


class HistogramObserver(Observer):
    """Running histogram with torch.ao's non-linear L2 search for the clipping range.

    Matches ``torch.ao.quantization.HistogramObserver`` exactly (same histogram, same search,
    same qparams) when ``[qmin, qmax]`` spans the full integer type, e.g. [-128, 127] against
    ``dtype=torch.qint8``: torch.ao spreads its search over ``2**bits`` levels of the dtype, this
    observer over ``2**bits`` levels of ``[qmin, qmax]``.

    Args:
        bins: histogram bins over the observed [min, max] (torch.ao's default 2048).
        upsample_rate: parts each old bin is split into when the range grows (torch.ao: 16).
        **kwargs: ``symmetric``, ``qmin``, ``qmax``, ``layer_name`` (see ``Observer``);
            ``channel_axis`` must be None.

    Example:
        >>> import torch
        >>> from torch.ao.quantization import HistogramObserver as TorchAOHistogramObserver
        >>> _ = torch.manual_seed(0)
        >>> obs = HistogramObserver(symmetric=False, qmin=-128, qmax=127)
        >>> ref = TorchAOHistogramObserver(dtype=torch.qint8, quant_min=-128, quant_max=127)
        >>> for batch in range(3):
        ...     x = torch.randn(1000) * (batch + 1) + 1
        ...     _ = obs(x); _ = ref(x)
        >>> obs.calculate_qparams() == ref.calculate_qparams()
        True
    """

    def __init__(self, *, bins: int = 2048, upsample_rate: int = 16, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.channel_axis is not None:
            raise UnsupportedError(
                f"{self.layer_name}: histogram observers are per-tensor only "
                f"(got channel_axis={self.channel_axis}). Use channel_axis=None, or a per-channel "
                "observer: 'minmax', 'moving_average_minmax' or 'percentile'."
            )
        if bins < 1 or upsample_rate < 1:
            raise UnsupportedError(
                f"{self.layer_name}: bins={bins} and upsample_rate={upsample_rate} must be "
                "positive; the defaults (2048, 16) are torch.ao's."
            )
        self.bins = bins
        self.upsample_rate = upsample_rate
        self.dst_nbins = 2 ** (self.qmax - self.qmin).bit_length()  # 256 for [-128, 127]
        self.register_buffer("histogram", torch.zeros(bins))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    # Accumulation (shared by every search) ------------------------------------------------------
    def observe(self, x: torch.Tensor) -> None:
        x_min, x_max = torch.aminmax(x)
        if int(self.num_batches) == 0:
            self.min_val, self.max_val = x_min, x_max
            self.histogram = torch.histc(x, self.bins, min=x_min, max=x_max)
            return
        new_min = torch.minimum(self.min_val, x_min)
        new_max = torch.maximum(self.max_val, x_max)
        update = torch.histc(x, self.bins, min=new_min, max=new_max)
        self.histogram = self._rebinned(new_min, new_max) + update
        self.min_val, self.max_val = new_min, new_max

    def _rebinned(self, new_min: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
        """The histogram moved onto ``bins`` bins over [new_min, new_max] ⊇ [min_val, max_val]."""
        old_min, old_max = self.min_val, self.max_val
        if bool(new_min == old_min) and bool(new_max == old_max):
            return self.histogram
        if bool(old_min == old_max):  # all mass at one value: it lands in that value's new bin
            return torch.histc(old_min, self.bins, min=new_min, max=new_max) * self.histogram.sum()
        fine_bins = self.bins * self.upsample_rate
        fine = self.histogram.repeat_interleave(self.upsample_rate) / self.upsample_rate
        fine_width = (old_max - old_min) / fine_bins
        device = self.histogram.device
        midpoints = torch.linspace(old_min, old_max, fine_bins + 1, device=device)[:-1]
        midpoints = midpoints + 0.5 * fine_width
        edges = torch.linspace(new_min, new_max, self.bins + 1, device=device)
        # Midpoints can land a hair outside [new_min, new_max] in float32; clamp into end bins.
        target = (torch.bucketize(midpoints, edges, right=True) - 1).clamp(0, self.bins - 1)
        return torch.bincount(target, weights=fine, minlength=self.bins)

    def _merge_key(self) -> tuple:
        return (*super()._merge_key(), self.bins, self.upsample_rate)

    def _merge_stats(self, other: HistogramObserver) -> None:
        """Both histograms re-binned onto the union of the two ranges, then added.

        Equal to one observer over both sides' batches when neither range had to grow (each
        side's first batch spanned the union): the counts are then the same ``histc`` counts,
        summed. Otherwise re-binning spreads a bin's mass over the bins it overlaps, as one
        observer does when a later batch widens its range, but not at the same moments, so
        the counts differ by that re-binning (a few per cent of the mass near bin edges) and the
        searched range by about a bin."""
        device = self._device()
        lo = torch.minimum(self.min_val, other.min_val.to(device))
        hi = torch.maximum(self.max_val, other.max_val.to(device))
        self.histogram = self._rebinned(lo, hi) + other._rebinned(
            lo.to(other.histogram.device), hi.to(other.histogram.device)
        ).to(device)
        self.min_val, self.max_val = lo, hi

    def value_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipped (min, max) chosen by ``search_range``; (min, max) for constant data."""
        self.check_calibrated()
        if bool(self.min_val == self.max_val):  # every search returns this range unchanged
            return self.min_val, self.max_val
        return self.search_range()

    # torch.ao's search ----------------------------------------------------------------------
    def search_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.ao's ``_non_linear_param_search``: greedy L2 minimization over bin ranges.

        Narrows [start_bin, end_bin] from whichever side holds less than the next 1e-5 of the
        mass, and stops at the first step that increases the L2 error (a local minimum). The
        loop runs on Python floats instead of tensor elements (same comparisons, float32
        thresholds as torch rounds them) so that it takes milliseconds, not seconds.
        """
        bin_width = (self.max_val - self.min_val) / self.bins
        total = self.histogram.sum().item()
        csum = self.histogram.cumsum(0).tolist()
        stepsize = 1e-5
        alpha, beta = 0.0, 1.0
        start_bin, end_bin = 0, self.bins - 1
        norm_min = float("inf")
        while alpha < beta:
            next_alpha, next_beta = alpha + stepsize, beta - stepsize
            lower, upper = _as_float32(next_alpha * total), _as_float32(next_beta * total)
            left, right = start_bin, end_bin
            while left < end_bin and csum[left] < lower:
                left += 1
            while right > start_bin and csum[right] > upper:
                right -= 1
            next_start_bin, next_end_bin = start_bin, end_bin
            if (left - start_bin) > (end_bin - right):
                next_start_bin, alpha = left, next_alpha
            else:
                next_end_bin, beta = right, next_beta
            if next_start_bin == start_bin and next_end_bin == end_bin:
                continue
            norm = self._l2_error(next_start_bin, next_end_bin)
            if norm > norm_min:
                break
            norm_min, start_bin, end_bin = norm, next_start_bin, next_end_bin
        return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)

    def _l2_error(self, start_bin: int, end_bin: int) -> float:
        """torch.ao's ``_compute_quantization_error``, same ops in the same order (same floats).

        The L2 error of quantizing the histogram (values uniform within each bin) to
        ``dst_nbins`` equal levels spanning bins [start_bin, end_bin]; bins outside are clipped.
        """
        bin_width = (self.max_val.item() - self.min_val.item()) / self.bins
        dst_width = bin_width * (end_bin - start_bin + 1) / self.dst_nbins
        if dst_width == 0.0:
            return 0.0
        last_dst = self.dst_nbins - 1
        device = self.histogram.device
        src_begin = (torch.arange(self.bins, device=device) - start_bin) * bin_width
        src_end = src_begin + bin_width
        dst_of_begin = torch.div(src_begin, dst_width, rounding_mode="floor").clamp(0, last_dst)
        dst_of_end = torch.div(src_end, dst_width, rounding_mode="floor").clamp(0, last_dst)
        density = self.histogram / bin_width
        # From each source bin's begin to the end of its destination level ...
        dst_of_begin_center = (dst_of_begin + 0.5) * dst_width
        norm = density * _cube_integral(
            src_begin - dst_of_begin_center, torch.ones(self.bins, device=device) * (dst_width / 2)
        )
        # ... whole levels the source bin spans ...
        half = torch.tensor(dst_width / 2)
        norm += (dst_of_end - dst_of_begin - 1) * (density * _cube_integral(-half, half))
        # ... and from the start of its last level to the source bin's end.
        dst_of_end_center = dst_of_end * dst_width + dst_width / 2
        norm += density * _cube_integral(torch.tensor(-dst_width / 2), src_end - dst_of_end_center)
        return norm.sum().item()

    # Shared by the MSE and entropy searches ----------------------------------------------------
    def _edges(self) -> torch.Tensor:
        """The ``bins + 1`` bin edges in float64."""
        steps = torch.arange(self.bins + 1, dtype=torch.float64, device=self.histogram.device)
        steps = steps / self.bins
        return self.min_val.double() + (self.max_val - self.min_val).double() * steps

    def _grid(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point (float64, one row per candidate) the real quantizer would use."""
        scale, zp = choose_qparams(lo, hi, symmetric=self.symmetric, qmin=self.qmin, qmax=self.qmax)
        return scale.double()[:, None], zp.double()[:, None]

    def _least_cost_range(self, cost_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipping range of least ``cost_fn(lo, hi)`` (vectors of candidates -> costs).

        Candidates shrink the observed range (widened to include 0, as ``choose_qparams``
        does) by ``f = k / bins``, k = 1 .. bins, so neighbours differ by about one bin.
        Symmetric: ``[-f a, f a]`` with ``a = max |x|``. Affine: each end shrinks on its own,
        the top then the bottom, twice over: outliers are often one-sided (GELU outputs,
        residual spikes) and shrinking both ends together would also clip the clean side.
        """
        lo = torch.clamp(self.min_val, max=0.0)
        hi = torch.clamp(self.max_val, min=0.0)
        if self.symmetric:
            hi = torch.maximum(-lo, hi)
            return self._shrink(cost_fn, -hi, hi, shrink_lo=True, shrink_hi=True)
        full_lo, full_hi = lo, hi
        for _ in range(2):
            _, hi = self._shrink(cost_fn, lo, full_hi, shrink_lo=False, shrink_hi=True)
            lo, _ = self._shrink(cost_fn, full_lo, hi, shrink_lo=True, shrink_hi=False)
        return lo, hi

    def _shrink(
        self, cost_fn, lo: torch.Tensor, hi: torch.Tensor, *, shrink_lo: bool, shrink_hi: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Best of ``(f lo or lo, f hi or hi)`` over ``f = k / bins``, coarse to fine.

        Scores every ``stride``-th k, then the ks within one stride of the best at a
        ``_REFINE`` times finer stride, down to stride 1. Ties go to the widest range.
        """
        stride = 1
        while stride * _COARSE < self.bins:
            stride *= _REFINE
        best, span = self.bins, self.bins
        while True:
            top, bottom = min(best + span - 1, self.bins), max(best - span, 0)
            # Widest first, so that argmin (the first minimum) breaks ties toward less clipping.
            k = torch.arange(top, bottom, -stride, device=self.histogram.device)
            f = k.double() / self.bins
            cand_lo = (lo.double() * f if shrink_lo else lo.double().expand_as(f)).float()
            cand_hi = (hi.double() * f if shrink_hi else hi.double().expand_as(f)).float()
            i = int(torch.argmin(cost_fn(cand_lo, cand_hi)))
            if stride == 1:
                return cand_lo[i], cand_hi[i]
            best, span, stride = int(k[i]), stride, stride // _REFINE


class HistogramMSEObserver(HistogramObserver):
    """The range minimizing the expected squared quantization error.

    Each candidate range of ``_least_cost_range`` is scored with its real qparams
    (``choose_qparams``, so symmetric vs affine, zero point alignment, rounding and clipping all
    count), integrating ``(x - dequantize(quantize(x)))^2`` exactly over each bin with values
    uniform within a bin.
    The whole family is scored on a coarse grid before refining around the best, so the search
    does not stop at the first local minimum as torch.ao's greedy one does; and unlike torch.ao's
    score it knows the scheme: a symmetric grid over all-positive data wastes half its levels.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> obs = HistogramMSEObserver(symmetric=True)
        >>> x = torch.randn(500_000)
        >>> x[0] = 100.0  # minmax: scale 100 / 127.5 = 0.78
        >>> _ = obs(x)
        >>> round(obs.calculate_qparams()[0].item(), 2)  # clips the outlier to ~28
        0.22
    """

    def search_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._least_cost_range(self._expected_sq_error)

    def _expected_sq_error(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Sum over bins of count * mean squared error within the bin, one value per candidate."""
        edges, counts = self._edges(), self.histogram.double()
        scale, zp = self._grid(lo, hi)
        low, high = scale * (self.qmin - zp), scale * (self.qmax - zp)  # lowest/highest level
        x = edges[None, :]
        # G(x) = integral from `low` to x of (t - q(t))^2 dt, in closed form: each whole level
        # step below x contributes scale^3/12, the rest r^3/3 (r = x - its nearest level), and
        # past a clip point the distance to the end level, (x - clipped x)^3 / 3, on top.
        inside = torch.clamp(x, low, high)
        t = (inside - low) / scale
        steps = torch.floor(t + 0.5)
        r = (t - steps) * scale
        g = steps * (scale**3 / 12) + (r**3 + (x - inside) ** 3) / 3
        return (g.diff(dim=1) * (counts / (edges[1] - edges[0]))).sum(dim=1)


class HistogramEntropyObserver(HistogramObserver):
    """TensorRT-style entropy calibration: the range of least KL(P || Q).

    For each candidate range of ``_least_cost_range``, with its real qparams: P is the histogram
    with the mass of clipped bins (centers beyond the end levels) added to the outermost kept
    bin; Q quantizes the kept bins (each quantization level gets the kept mass that rounds to
    it) and spreads each level's mass evenly over the level's bins where P is non-zero. Clipping
    a tail therefore costs the spike it piles onto the end bin; a coarse grid costs the detail
    it flattens. Differences from TensorRT's reference code, on purpose:

    - levels come from the actual quantizer (symmetric or affine, zero point included) instead
      of merging ``i`` histogram bins of ``|x|`` into 128 groups, so affine works too;
    - a P-bin whose level holds no kept data gets ``_KL_EPS`` counts in Q (the smoothing of
      MXNet and ONNX Runtime) instead of an infinite divergence, which would forbid clipping
      an isolated outlier;
    - candidates whose level step is narrower than a histogram bin are skipped: the histogram
      cannot show their rounding error (TensorRT's "start at bin 128" rule). With one huge
      outlier the step therefore shrinks to one bin, ``(max - min) / bins``, and no further.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> obs = HistogramEntropyObserver(symmetric=True)
        >>> x = torch.randn(100_000)
        >>> x[0] = 50.0  # minmax: scale 50 / 127.5 = 0.39; torch.ao's search keeps it too
        >>> _ = obs(x)
        >>> round(obs.calculate_qparams()[0].item(), 2)  # clips at the edge of the bulk, ~4.6
        0.04
    """

    def search_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._least_cost_range(self._kl_divergence)

    def _kl_divergence(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """KL(P || Q) per candidate; inf where the level step is below a bin or all is clipped."""
        edges, counts = self._edges(), self.histogram.double()
        centers = (edges[:-1] + edges[1:]) / 2
        scale, zp = self._grid(lo, hi)
        unclamped = torch.round(centers / scale) + zp
        level = unclamped.clamp(self.qmin, self.qmax)
        kept = level == unclamped
        level = (level - self.qmin).long()
        kept_counts = counts * kept
        # P: clipped mass moves onto the first/last kept bin. Levels grow with the bin centers,
        # so the kept bins are one contiguous run: [n_below, n_below + n_kept).
        n_below = (unclamped < self.qmin).sum(dim=1, keepdim=True)
        n_kept = kept.sum(dim=1, keepdim=True)
        below = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # below[j]: mass of bins < j
        first, last = n_below.clamp(max=self.bins - 1), (n_below + n_kept - 1).clamp(min=0)
        p = kept_counts.clone()
        p.scatter_add_(1, first, below[n_below])
        p.scatter_add_(1, last, below[-1] - below[n_below + n_kept])
        # Q: each level's kept mass spread evenly over the level's bins where P is non-zero.
        nonzero = p > 0
        level_mass = counts.new_zeros(len(lo), self.qmax - self.qmin + 1)
        level_bins = torch.zeros_like(level_mass)
        level_mass.scatter_add_(1, level, kept_counts)
        level_bins.scatter_add_(1, level, nonzero.double())
        q = level_mass.gather(1, level) / level_bins.gather(1, level).clamp(min=1.0)
        q = torch.where(nonzero, q.clamp(min=_KL_EPS), 0.0)
        p = p / p.sum(dim=1, keepdim=True)
        q = q / q.sum(dim=1, keepdim=True)
        kl = torch.where(nonzero, p * torch.log(p / q), 0.0).sum(dim=1)
        judged = (n_kept[:, 0] > 0) & (scale[:, 0] >= edges[1] - edges[0])
        return torch.where(judged, kl, float("inf"))
