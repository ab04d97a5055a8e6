"""Non-finite marks: where a float tensor is quantized, NaN and ±Inf would become finite codes
(int8 has none; e4m3 saturates ±Inf), so the mark is taken from the float tensor and put back
into the float output as NaN.

Plain torch ops with no host synchronisation (no ``.item()``, no data-dependent shapes): they
trace, export, compile and CUDA-graph like the rest of the model. The float model gives NaN or
±Inf where its input was non-finite; the quantized model gives NaN there (the sign of an Inf is
not kept: an int8 GEMM cannot say which output columns an Inf would reach with which sign).
"""

from __future__ import annotations

import torch

NAN = float("nan")


def nonfinite_rows(x: torch.Tensor, row_dims: int) -> torch.Tensor:
    """A bool mark per row of ``x``'s first ``row_dims`` dimensions: True where any value of the
    row is NaN or ±Inf. ``row_dims=0`` gives one 0-d mark for the whole tensor.

    Example:
        >>> x = torch.tensor([[1.0, float("nan")], [2.0, 3.0], [float("-inf"), 0.0]])
        >>> nonfinite_rows(x, 1).tolist()
        [True, False, True]
        >>> nonfinite_rows(x, 0).item()
        True
    """
    finite = torch.isfinite(x)
    if row_dims == 0:
        return ~finite.all()
    return ~finite.flatten(row_dims).all(-1) if x.dim() > row_dims else ~finite


def poison_rows(out: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
    """``out`` with NaN in every row ``mark`` flags (``mark``'s dimensions lead ``out``'s; a 0-d
    mark flags the whole tensor). Non-float outputs come back unchanged.

    Example:
        >>> out = torch.ones(3, 2)
        >>> poison_rows(out, torch.tensor([False, True, False])).tolist()
        [[1.0, 1.0], [nan, nan], [1.0, 1.0]]
    """
    if not out.is_floating_point() or out.dtype == torch.float8_e4m3fn:
        return out
    mark = mark.reshape(*mark.shape, *([1] * (out.dim() - mark.dim())))
    return out.masked_fill(mark, NAN)


def any_marks(*marks: torch.Tensor) -> torch.Tensor:
    """One 0-d mark: True if any of ``marks`` flags any row."""
    out = marks[0].any()
    for mark in marks[1:]:
        out = out | mark.any()
    return out


def merge_marks(*marks: torch.Tensor) -> torch.Tensor:
    """Rows flagged by any of ``marks`` (each [B] or 0-d; broadcast together)."""
    out = marks[0]
    for mark in marks[1:]:
        out = out | mark
    return out
