"""4-bit weights: group qparams, rounding, packing (the numerics contract of every 4-bit layer).

A 4-bit weight [N, K] is cut along K into groups of ``group_size`` columns (the last one may be
shorter; ``group_size=None`` is one group per row, i.e. per channel). Each (row, group) has a
float32 scale and, asymmetric, an integer zero point; codes are signed, in [-8, 7]:

    q = clamp(round(w / scale) + zero, -8, 7)        w ≈ (q - zero) * scale

Symmetric groups take ``scale = amax / 7.5`` and ``zero = 0``, asymmetric ones
``scale = (max - min) / 15`` and ``zero = -8 - round(min / scale)`` (both ranges include 0). These
are compressed-tensors' conventions, so its ``pack_quantized`` checkpoints (llm-compressor's
W4A16) load onto qfuse's layers code for code and qfuse's layers export the same way.

Storage is compressed-tensors' packing too: eight codes per int32 along K, code ``j`` of word
``w`` (column ``8 w + j``) in bits ``4 j .. 4 j + 3`` as ``q + 8``; a last partial word is padded
with zero bits, as compressed-tensors writes it. Zero points pack the same way along N
(``pack_rows``).

Example:
    >>> import torch
    >>> w = torch.tensor([[0.5, -1.0, 0.25, 0.0, 1.0, -0.5, 0.75, -0.25, 0.1]])
    >>> scale, zero = group_qparams(w, group_size=None, symmetric=True)
    >>> q = quantize_groups(w, scale, zero, group_size=None)
    >>> q.tolist()
    [[4, -7, 2, 0, 7, -4, 6, -2, 1]]
    >>> packed = pack(q)
    >>> packed.shape, torch.equal(unpack(packed, 9), q)
    (torch.Size([1, 2]), True)
"""

from __future__ import annotations

import math

import torch

from qfuse.errors import UnsupportedError

QMIN, QMAX = -8, 7
SCALE_EPS = torch.finfo(torch.float32).eps
PER_WORD = 8  # 4-bit codes per int32


def groups_of(in_features: int, group_size: int | None) -> int:
    """How many groups a row of ``in_features`` has."""
    size = group_size or in_features
    return math.ceil(in_features / size)


def check_group_size(group_size: int | None, what: str = "group_size") -> None:
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool)
                                   or group_size < 8 or group_size % 8):
        raise UnsupportedError(
            f"{what}={group_size!r}: 4-bit weights take a group size that is a positive multiple "
            "of 8 (128 and 64 are the usual ones), or None for one scale per output channel."
        )


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``w`` [N, K] as [N, G, size], zero-padded along K (padding never moves a range that
    already includes 0)."""
    n, k = w.shape
    size = group_size or k
    g = math.ceil(k / size)
    if g * size != k:
        w = torch.nn.functional.pad(w, (0, g * size - k))
    return w.reshape(n, g, size)


def group_qparams(w: torch.Tensor, group_size: int | None, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale float32 [N, G], zero int8 [N, G] or None when symmetric) of weight ``w`` [N, K]."""
    grouped = _grouped(w.detach().float(), group_size)
    if symmetric:
        amax = grouped.abs().amax(dim=2)
        return torch.clamp(amax / ((QMAX - QMIN) / 2), min=SCALE_EPS), None
    lo = grouped.amin(dim=2).clamp(max=0.0)
    hi = grouped.amax(dim=2).clamp(min=0.0)
    scale = torch.clamp((hi - lo) / (QMAX - QMIN), min=SCALE_EPS)
    zero = torch.clamp(QMIN - torch.round(lo / scale), QMIN, QMAX)
    return scale, zero.to(torch.int8)


def expand(t: torch.Tensor, in_features: int, group_size: int | None) -> torch.Tensor:
    """Per-group [N, G] values repeated over each group's columns: [N, in_features]."""
    size = group_size or in_features
    return t.repeat_interleave(size, dim=1)[:, :in_features]


def quantize_groups(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    group_size: int | None) -> torch.Tensor:
    """int8 codes in [-8, 7] of ``w`` [N, K] against its group ``scale`` (and ``zero``)."""
    k = w.shape[1]
    v = torch.round(w.detach().float() / expand(scale, k, group_size))
    if zero is not None:
        v = v + expand(zero, k, group_size).float()
    return torch.clamp(v, QMIN, QMAX).to(torch.int8)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      group_size: int | None) -> torch.Tensor:
    """float32 ``(q - zero) * scale`` [N, K]: exact (small integers times one float32 each)."""
    k = q.shape[1]
    v = q.float()
    if zero is not None:
        v = v - expand(zero, k, group_size).float()
    return v * expand(scale.float(), k, group_size)


def fake_quantize_groups(w: torch.Tensor, group_size: int | None, symmetric: bool
                         ) -> torch.Tensor:
    """Round-to-nearest 4-bit ``w`` back in float32 (what the layer computes with)."""
    scale, zero = group_qparams(w, group_size, symmetric)
    return dequantize_groups(quantize_groups(w, scale, zero, group_size), scale, zero, group_size)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> int32 [N, ceil(K / 8)] (compressed-tensors' layout)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise UnsupportedError(f"int4.pack takes 2-D int8 codes, got {q.dtype} {tuple(q.shape)}.")
    n, k = q.shape
    words = math.ceil(k / PER_WORD)
    v = (q.to(torch.int32) + 8) & 0xF
    if words * PER_WORD != k:
        v = torch.nn.functional.pad(v, (0, words * PER_WORD - k))  # never read back
    v = v.reshape(n, words, PER_WORD)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # bits 28..31 of the last nibble wrap the int32 sign: summing the shifted nibbles in int64
    # and reinterpreting the low 32 bits keeps them
    out = (v.to(torch.int64) << shifts.to(torch.int64)).sum(dim=2)
    return (out - ((out >> 31) & 1) * (1 << 32)).to(torch.int32)


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] -> int8 codes [N, K] (``K = in_features``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF
    return (nib.reshape(packed.shape[0], -1)[:, :in_features] - 8).to(torch.int8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, G] packed along N: int32 [ceil(N / 8), G] (compressed-tensors' zero points)."""
    return pack(q.t().contiguous()).t().contiguous()


def unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    return unpack(packed.t().contiguous(), rows).t().contiguous()
