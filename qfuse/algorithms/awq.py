"""AWQ: activation-aware scales and clips for 4-bit weights (Lin et al., 2024).

A few input channels carry much larger activations than the rest; their weight columns matter
most, and 4-bit group rounding serves them no better than any other column. For a Linear
``y = x W^T`` and per-input-channel factors ``s``, ``y = (x / s) (W s)^T`` exactly; multiplying
a salient column by ``s_j > 1`` before rounding shrinks its relative rounding error (the group
scale barely moves), and ``x / s`` is folded into the op before (free at run time).

Per input (the layers reading one value share one ``s``: Q, K, V after ``input_layernorm``;
gate, up after ``post_attention_layernorm``) the search tries ``s = mean|x|^ratio`` (with
``duo_scaling``, llm-compressor's default: ``mean|x|^ratio / mean|W~|^(1 - ratio)``, ``W~`` the
weight normalised by its group max), ``ratio`` over ``range(grid) / grid``, normalised so that
``sqrt(max(s) min(s)) = 1``, and keeps the one with the least squared output error of the
quantized layers, ``|x W^T - Q(x / s) Q(W s)^T|^2`` summed over the recorded calibration rows
and the group's outputs, or no scaling (``s = 1``, round-to-nearest) when none beats it. With
``clip`` each (output row, group) of every AWQ layer then gets the max-clip ratio, from
``1, 1 - 1/clip_grid, ...`` down to ``1 - max_shrink``, whose clamped-then-rounded weights give
the least output error on the same rows (llm-awq's ``auto_clip``; asymmetric groups shrink
both ends of their range); the weights are clamped there, so round-to-nearest and GPTQ take
the clipped range.

Where ``x / s`` goes is SmoothQuant's folding (``qfuse.flows.plan.fold_norms`` and
``apply_factors``): into an RMSNorm weight that only AWQ layers read, into the rows of a
producer Linear only this layer reads, or into the ``up`` rows behind a gated product
(``down_proj``) or the ``v`` rows behind an attention (``o_proj``; with GQA the query heads of
one ``v`` row share a factor), the peers' ``up -> down`` and ``v -> o`` mappings
(``qfuse.algorithms.row_folds``), when ``up`` / ``v`` is quantized. Inputs with none of these
(4-bit layers have no prologue to apply a vector in) are not scaled, only clipped. The error
measured is each layer's own output, not the whole attention / MLP block's as llm-awq measures
it. GPTQ composes: it runs after AWQ on the scaled, clipped weights, with the Hessian of
``x / s``; SmoothQuant before AWQ multiplies its factors onto AWQ's (``apply_factors``).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from qfuse import int4
from qfuse.algorithms.row_folds import tie
from qfuse.errors import QFuseError, UnsupportedError
from qfuse.fusion.patterns import Chain
from qfuse.observers.samples import InputSamples


@dataclass(frozen=True)
class AWQ:
    """AWQ for 4-bit weight configs (``qfuse.prepare(..., awq=qfuse.AWQ())``).

    Args:
        grid: scale exponents tried per input, ``ratio in range(grid) / grid`` (20 as llm-awq).
        layers: globs of Linear layer names AWQ applies to; ``None``: every Linear. An RMSNorm
            takes the factors only when every layer reading it is named (its readers share one
            ``s``); the others are then only clipped.
        clip: also search each (row, group)'s weight clip ratio (llm-awq's ``auto_clip``).
        clip_grid: the clip ratios' step is ``1 / clip_grid``.
        max_shrink: the smallest clip ratio tried is ``1 - max_shrink``.
        duo_scaling: ``s = mean|x|^r / mean|W~|^(1 - r)`` (llm-compressor's default) rather than
            llm-awq's ``mean|x|^r``.

    Example:
        >>> import qfuse
        >>> qfuse.AWQ().describe(), qfuse.AWQ(clip=False, grid=10).describe()
        ('AWQ (grid=20, clip)', 'AWQ (grid=10)')
    """

    grid: int = 20
    layers: tuple[str, ...] | None = None
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    duo_scaling: bool = True

    def __post_init__(self) -> None:
        for key in ("grid", "clip_grid"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UnsupportedError(f"AWQ {key}={value!r} must be a positive int (20 is the "
                                       "default).")
        if isinstance(self.layers, str):
            raise UnsupportedError("AWQ layers takes a tuple of globs, not one string: "
                                   f"AWQ(layers=({self.layers!r},)).")
        for key in ("clip", "duo_scaling"):
            if not isinstance(getattr(self, key), bool):
                raise UnsupportedError(f"AWQ {key}={getattr(self, key)!r}: pass True or False.")
        if not isinstance(self.max_shrink, (int, float)) or not 0.0 < self.max_shrink < 1.0:
            raise UnsupportedError(f"AWQ max_shrink={self.max_shrink!r} must lie in (0, 1) "
                                   "(0.5, the default, tries clip ratios down to 0.5).")

    def describe(self) -> str:
        return f"AWQ (grid={self.grid}{', clip' if self.clip else ''})"


class AWQSamples(InputSamples):
    """``InputSamples`` that also keeps the mean ``|x|`` per input channel over every row seen
    (AWQ's activation statistic; the row sample always holds each sequence's first row, which
    would bias a mean taken over it).

    Example:
        >>> import torch
        >>> s = AWQSamples(layer_name="fc", max_rows=4)
        >>> _ = s(torch.tensor([[[1.0, -2.0], [3.0, 0.0]]]))
        >>> s.abs_mean.tolist(), tuple(s.rows.shape)
        ([2.0, 1.0], (2, 2))
    """

    def __init__(self, *, layer_name: str, max_rows: int = 512, seed: int = 0) -> None:
        super().__init__(layer_name=layer_name, max_rows=max_rows, seed=seed)
        self.register_buffer("abs_sum", torch.zeros(0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = int(self.num_rows)
        out = super().forward(x)
        if int(self.num_rows) != before:  # recorded (enabled, floating, non-empty)
            part = x.detach().abs().reshape(-1, x.shape[-1]).sum(0, dtype=torch.float64)
            self.abs_sum = part if self.abs_sum.numel() == 0 else self.abs_sum + part
        return out

    def _merge_stats(self, other: AWQSamples) -> None:
        super()._merge_stats(other)
        self.abs_sum = self.abs_sum + other.abs_sum.to(self.abs_sum.device)

    @property
    def abs_mean(self) -> torch.Tensor:
        """float32 [K]: mean |x| per input channel over every calibration row."""
        return (self.abs_sum / max(int(self.num_rows), 1)).float()

    def check_calibrated(self) -> None:
        if int(self.num_rows) == 0:
            raise QFuseError(
                f"{self.layer_name}: no calibration data reached this layer, so AWQ's search has "
                "nothing to measure. Run calibration batches through the prepared model before "
                "qfuse.convert."
            )


def select(chains: list[Chain], cfg: AWQ, config) -> list[str]:
    """Names of the Linear chains AWQ applies to (``cfg.layers``, or every Linear); errors for a
    config without 4-bit weights, a glob matching nothing, a glob naming only non-Linear layers
    and an empty selection."""
    from qfuse.validate import check_layer_globs

    if getattr(config, "weight_bits", 8) != 4:
        raise UnsupportedError(
            "AWQ searches scales for 4-bit group weights, and this config has "
            f"{config.weight_bits}-bit weights; use QConfig.w4a16(...) / w4a8(...), or "
            "SmoothQuant(search=True) for int8 / fp8 weights."
        )
    check_layer_globs(dict.fromkeys(cfg.layers or ()), chains, "AWQ(layers=...)")
    picked = []
    for chain in chains:
        named = cfg.layers is None or any(fnmatch.fnmatchcase(chain.name, g) for g in cfg.layers)
        if not named:
            continue
        if chain.kind != "linear":
            if cfg.layers is not None:
                raise UnsupportedError(
                    f"layer {chain.name}: AWQ applies to Linear layers (4-bit weights cover "
                    f"Linears), not {chain.kind}; leave it out of AWQ(layers=...)."
                )
            continue
        picked.append(chain.name)
    if not picked:
        raise UnsupportedError(
            "AWQ: no Linear layer to apply to (this model's layers: "
            f"{[c.name for c in chains][:8]}); drop awq= from qfuse.prepare."
        )
    return picked


def weight_mean(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Per input channel, the mean over output rows of ``|W|`` normalised by its group's max
    (llm-compressor's ``w_mean``): float32 [K]."""
    k = weight.shape[1]
    grouped = int4._grouped(weight.detach().float().abs(), group_size)
    normed = grouped / grouped.amax(dim=2, keepdim=True).clamp(min=1e-12)
    return normed.reshape(weight.shape[0], -1)[:, :k].mean(0)


def candidate(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float,
              fold_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The factors ``s`` of one ``ratio``: ``x_mean^ratio`` (over ``w_mean^(1 - ratio)`` when
    given), clamped to 1e-4 and normalised so that ``max(s) * min(s) = 1``. ``fold_rows``: a
    ``RowFold``'s rows; channels folding into one row take their group's largest factor
    (``tie``)."""
    s = x_mean.float().pow(ratio)
    if w_mean is not None:
        s = s / (w_mean.float().pow(1.0 - ratio) + 1e-4)
    s = tie(s.clamp(min=1e-4), fold_rows)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(
    rows: torch.Tensor,
    x_mean: torch.Tensor,
    weight: torch.Tensor,
    group_size: int | None,
    symmetric: bool,
    *,
    grid: int = 20,
    duo_scaling: bool = True,
    act=None,
    fold_rows: torch.Tensor | None = None,
) -> tuple[float | None, torch.Tensor | None, float]:
    """(ratio, s, error) for one input whose readers' weights, stacked, are ``weight`` [N, K]:
    the candidate ``s`` with the least ``|x W^T - act(x / s) Q(W s)^T|^2`` over ``rows`` [n, K]
    (``act``: the activation rounding of ``x / s``, None for float activations); ``(None, None,
    error)`` when no candidate beats ``s = 1`` (plain round-to-nearest). ``fold_rows``: the
    fold's (``candidate``).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(256, 64, generator=g); x[:, 5] *= 30  # one salient channel
        >>> w = torch.randn(32, 64, generator=g)
        >>> ratio, s, err = search_scale(x, x.abs().mean(0), w, 16, True)
        >>> ratio is not None and bool(s[5] == s.max())
        True
    """
    rows = rows.float()
    weight = weight.detach().float()
    want = rows @ weight.T
    act = act or (lambda xs, s: xs)

    def error(s: torch.Tensor | None) -> float:
        if s is None:
            got = act(rows, None) @ int4.fake_quantize_groups(weight, group_size, symmetric).T
        else:
            wq = int4.fake_quantize_groups(weight * s[None, :], group_size, symmetric)
            got = act(rows / s, s) @ wq.T
        return float((got - want).pow(2).sum())

    best = (error(None), None, None)
    w_mean = weight_mean(weight, group_size) if duo_scaling else None
    for i in range(grid):
        ratio = i / grid
        s = candidate(x_mean, w_mean, ratio, fold_rows)
        err = error(s)
        if err < best[0]:
            best = (err, ratio, s)
    return best[1], best[2], best[0]


@torch.no_grad()
def search_clip(
    rows: torch.Tensor,
    weight: torch.Tensor,
    group_size: int | None,
    symmetric: bool,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped weight [N, K], ratio [N, G]): per (output row, group), the clip ratio ``r`` in
    ``1, 1 - 1/grid, ...`` (down to ``1 - max_shrink``) whose range (``[-r amax, r amax]``
    symmetric, ``[r min, r max]`` asymmetric) gives round-to-nearest weights with the least
    squared output error ``|x_g (Q(clamp(w_g)) - w_g)|^2`` over ``rows``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x, w = torch.randn(256, 64, generator=g), torch.randn(16, 64, generator=g)
        >>> clipped, ratio = search_clip(x, w, 32, True)
        >>> tuple(ratio.shape), bool((ratio < 1).any()), bool(clipped.abs().max() <= w.abs().max())
        ((16, 2), True, True)
    """
    n, k = weight.shape
    size = group_size or k
    g = math.ceil(k / size)
    w = int4._grouped(weight.detach().float(), group_size)  # [N, G, size]
    x = rows.float()
    if g * size != k:
        x = torch.nn.functional.pad(x, (0, g * size - k))
    x = x.reshape(-1, g, size).transpose(0, 1)  # [G, n, size]
    if symmetric:
        hi0 = w.abs().amax(dim=2, keepdim=True)
        lo0 = -hi0
    else:
        lo0, hi0 = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
    best_err = torch.full((n, g), float("inf"))
    best = torch.ones(n, g)
    for i in range(max(1, int(max_shrink * grid))):
        r = 1.0 - i / grid
        clamped = torch.minimum(torch.maximum(w, lo0 * r), hi0 * r)
        q = int4.fake_quantize_groups(clamped.reshape(n, -1), size, symmetric).reshape(n, g, size)
        delta = (q - w).permute(1, 2, 0)  # [G, size, N]
        err = torch.bmm(x, delta).pow(2).sum(1).T  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    r = best[:, :, None]
    clipped = torch.minimum(torch.maximum(w, lo0 * r), hi0 * r).reshape(n, -1)[:, :k]
    return clipped, best
