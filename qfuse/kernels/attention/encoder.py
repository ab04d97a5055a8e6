"""Encoder attention (flash-attention forward) whose epilogue writes the next GEMM's input.

    out[b, s, h*D + d] = softmax(q[b, h] @ k[b, h]^T * scale + mask)[s] @ v[b, h]   (fp32 softmax)

written in the [B, S, H*D] row layout the attention-output Linear reads, either in the model's
float dtype or quantized with that Linear's static per-tensor scale (int8 with an optional zero
point, or fp8 e4m3). In a converted encoder SDPA writes a bf16 [B, H, S, D] tensor, the graph
transposes it, and the Linear quantizes it in a separate pass: here that is one store of one byte
an element. The quantized value is taken from the output rounded to the float dtype first, which
is what a separate quantize pass sees, so the fused and unfused graphs agree up to the attention's
own float rounding.

q, k, v are [B, H, S, D] read through their strides (the fused-QKV GEMM's [B, S, 3*H*D] output
sliced, viewed and transposed needs no copy). The mask, boolean (True keeps) or additive, is any
tensor broadcastable to [B, H, S_Q, S_K] (export's [B, 1, S, S] and [B, 1, 1, S] forms), read
with stride 0 over its broadcast dimensions. Non-causal, no dropout: encoder inference.

Online softmax as in Triton's fused-attention tutorial: one program owns BLOCK_M query rows of
one (batch, head) and sweeps the keys BLOCK_N at a time, keeping the running row max ``m``, the
running sum ``l`` and the unnormalized output in registers; scores are kept in the log2 domain
(``scale * log2 e`` folded into one multiply) so each probability is one ``exp2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.common import quantize_fp8, quantize_int8, round_to_float_grid

LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn
# (stored mantissa bits, smallest normal exponent) of the float output grids; 0: float32, no
# rounding
_GRIDS = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (0, 0)}
_OUT_CODES = {torch.int8: 1, FP8: 2}  # anything else: the float dtype of q (code 0)


@triton.jit
def flash_tile(q, cols, end, row_ok, offs_d, d_ok, k_base, v_base, m_base,
               stride_kl, stride_kd, stride_vl, stride_vd, stride_ml, m_i, l_i, acc,
               QK_SCALE: tl.constexpr, MASK: tl.constexpr, EXACT: tl.constexpr,
               IEEE: tl.constexpr, Y_MANT: tl.constexpr, Y_EMIN: tl.constexpr):
    """One key tile of the online softmax (shared with ``decode_attention``): the scores of the
    rows of ``q`` against keys ``cols`` (those at or past ``end`` dropped), masked (``MASK``: 0
    none, 1 boolean, 2 additive; a key is dropped where a boolean mask is False or an additive
    one -inf), folded into the running row max ``m_i`` (log2 domain), row sum ``l_i`` and
    unnormalized output ``acc``. Returns the three updated."""
    col_ok = cols < end
    kt = tl.load(k_base + cols[None, :] * stride_kl + offs_d[:, None] * stride_kd,
                 mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    if EXACT:  # the interpreter's dot reads bf16/fp16 operands as their raw bits: upcast
        kt = kt.to(tl.float32)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * QK_SCALE
    keep = row_ok[:, None] & col_ok[None, :]
    if MASK == 1:
        mv = tl.load(m_base + cols[None, :] * stride_ml, mask=keep, other=0)
        keep = keep & (mv != 0)
    elif MASK == 2:
        mv = tl.load(m_base + cols[None, :] * stride_ml, mask=keep, other=0.0).to(tl.float32)
        keep = keep & (mv != float("-inf"))
        # finfo.min masks (transformers') would overflow to -inf times log2 e; clamped they
        # stay finite, so a row masked everywhere with them still averages as SDPA's does.
        s = s + tl.maximum(mv, -2.0e38) * 1.4426950408889634
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing kept so far has m = -inf: subtract 0 instead (exp2(-inf) = 0, no NaN).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    if EXACT:  # P on v's grid as the GPU's cast rounds it (the interpreter's truncates)
        v = v.to(tl.float32)
        if Y_MANT > 0:
            p = round_to_float_grid(p, Y_MANT, Y_EMIN)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, mask_ptr, inv_scale_ptr, zp_ptr, out_ptr,
    # dimensions
    H, S_Q, S_K, D,
    # strides: q, k, v [B, H, S, D]; mask [B, H, S_Q, S_K] (0 where broadcast); out [B, S_Q, H*D]
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_ob, stride_os,
    # meta-parameters (the softmax scale times log2 e a constexpr too: Inductor passes a Python
    # float as fp64, which would make the scores fp64)
    QK_SCALE: tl.constexpr,
    MASK: tl.constexpr,  # 0: none, 1: boolean (nonzero keeps), 2: additive
    OUT: tl.constexpr,  # 0: q's float dtype, 1: int8, 2: fp8 e4m3
    HAS_ZP: tl.constexpr,
    Y_MANT: tl.constexpr, Y_EMIN: tl.constexpr,  # the float dtype's grid (0: float32)
    EXACT: tl.constexpr,  # interpreter: round with integer ops (its casts truncate)
    IEEE: tl.constexpr,  # float32 inputs: full-precision dots, not tf32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_Q
    d_ok = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if EXACT:  # the interpreter's dot reads bf16/fp16 operands as their raw bits: upcast
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    m_base = mask_ptr + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, S_K, BLOCK_N):
        m_i, l_i, acc = flash_tile(
            q, start + offs_n, S_K, row_ok, offs_d, d_ok, k_base, v_base, m_base,
            stride_ks, stride_kd, stride_vs, stride_vd, stride_mk, m_i, l_i, acc,
            QK_SCALE, MASK, EXACT, IEEE, Y_MANT, Y_EMIN,
        )

    # A row with every key masked: 0, as SDPA's safe softmax gives.
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    y = tl.math.div_rn(acc, denom[:, None])
    if Y_MANT > 0:  # the float output's grid first: what a separate quantize pass reads
        y = round_to_float_grid(y, Y_MANT, Y_EMIN)
    out = out_ptr + b * stride_ob + offs_m[:, None] * stride_os + h * D + offs_d[None, :]
    ok = row_ok[:, None] & d_ok[None, :]
    if OUT == 0:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        inv = tl.load(inv_scale_ptr)
        if OUT == 2:
            tl.store(out, quantize_fp8(y, inv, EXACT), mask=ok)
        else:
            zp = 0.0
            if HAS_ZP:
                zp = tl.load(zp_ptr).to(tl.float32)
            tl.store(out, quantize_int8(y, inv, zp), mask=ok)


# ---- schedules ----

@dataclass(frozen=True)
class AttentionSchedule:
    """Query rows and keys a program holds per step, warps, software-pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def seq_bucket(seq: int) -> int:
    """The schedule table's sequence key: 128, 256 or 512 (longer sequences use 512's)."""
    return 128 if seq <= 128 else 256 if seq <= 256 else 512


# (head_dim, seq bucket) -> schedule. Head dims 32 and 64 at 128 and 512 keys were timed on an
# H200 with the boolean mask a converted graph carries (bench/attention_ab.py): 64 query rows x 32
# keys, 4 warps, 3 stages won at BERT-base 32x128 and 8x512 and MiniLM 32x128, and came within a
# hair at MiniLM 1x128 (where 32x64 won narrowly but lost 2x at 32x128); the 256 bucket takes the
# same. Head dim 128 keeps the tutorial's Hopper configs (not timed).
SCHEDULES: dict[tuple[int, int], AttentionSchedule] = {
    (32, 128): AttentionSchedule(64, 32, 4, 3),
    (32, 256): AttentionSchedule(64, 32, 4, 3),
    (32, 512): AttentionSchedule(64, 32, 4, 3),
    (64, 128): AttentionSchedule(64, 32, 4, 3),
    (64, 256): AttentionSchedule(64, 32, 4, 3),
    (64, 512): AttentionSchedule(64, 32, 4, 3),
    (128, 128): AttentionSchedule(64, 64, 4, 2),
    (128, 256): AttentionSchedule(128, 64, 8, 3),
    (128, 512): AttentionSchedule(128, 64, 8, 3),
}
# Other head dims: by the smallest head dim of the table at or above it.
_HEAD_DIMS = sorted({d for d, _ in SCHEDULES})


def pick_schedule(head_dim: int, seq: int) -> AttentionSchedule:
    d = next((d for d in _HEAD_DIMS if d >= head_dim), _HEAD_DIMS[-1])
    return SCHEDULES[(d, seq_bucket(seq))]


# ---- launcher ----

def check_inputs(q, k, v, mask, out_dtype, inv_scale) -> None:
    """Raise a typed error for inputs the kernel does not compute (named, with the fix)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"attention_quant: q, k, v must be [B, H, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    B, H, _, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H) or k.shape[3] != D or (
        v.shape[2] != k.shape[2]
    ):
        raise ShapeError(f"attention_quant: k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         f"match q {tuple(q.shape)} in batch, heads and head dim (no GQA), and "
                         "each other in keys.")
    if v.shape[3] != D or D > 256:
        raise UnsupportedError(f"attention_quant: head dims q {D}, v {v.shape[3]}; the kernel "
                               "computes equal head dims up to 256.")
    if q.dtype not in _GRIDS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"attention_quant: q, k, v dtypes {q.dtype}, {k.dtype}, "
                               f"{v.dtype}; give one of float32, bfloat16, float16 for all.")
    if out_dtype not in _OUT_CODES and out_dtype != q.dtype:
        raise UnsupportedError(f"attention_quant: out_dtype {out_dtype}; use torch.int8, "
                               f"torch.float8_e4m3fn or q's dtype {q.dtype}.")
    if out_dtype in _OUT_CODES and inv_scale is None:
        raise UnsupportedError("attention_quant: a quantized output needs inv_scale.")
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise UnsupportedError(f"attention_quant: mask dtype {mask.dtype}; give a boolean "
                               "(True keeps) or an additive float mask.")


def launch_args(q, k, v, mask, scale, inv_scale, zero_point, out_dtype, interpreted,
                schedule=None):
    """Grid, arguments (by name, in the kernel's order), launch options and the output
    [B, S_Q, H*D] of one launch. ``scale`` None: 1/sqrt(D), as SDPA's default."""
    check_inputs(q, k, v, mask, out_dtype, inv_scale)
    B, H, S_Q, D = q.shape
    S_K = k.shape[2]
    out = torch.empty((B, S_Q, H * D), device=q.device, dtype=out_dtype)
    code = _OUT_CODES.get(out_dtype, 0)
    if mask is not None:
        try:
            mask = mask.expand(B, H, S_Q, S_K)  # a view: stride 0 where broadcast
        except RuntimeError:
            raise ShapeError(f"attention_quant: mask {tuple(mask.shape)} does not broadcast to "
                             f"[B, H, S_Q, S_K] = {[B, H, S_Q, S_K]}.") from None
    sched = schedule or pick_schedule(D, S_K)
    mant, emin = _GRIDS[q.dtype]
    scale = float(scale) if scale is not None else D ** -0.5
    dummy = out
    mstrides = mask.stride() if mask is not None else (0, 0, 0, 0)
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, mask_ptr=mask if mask is not None else dummy,
        inv_scale_ptr=inv_scale if inv_scale is not None else dummy,
        zp_ptr=zero_point if zero_point is not None else dummy, out_ptr=out,
        H=H, S_Q=S_Q, S_K=S_K, D=D,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qs=q.stride(2), stride_qd=q.stride(3),
        stride_kb=k.stride(0), stride_kh=k.stride(1), stride_ks=k.stride(2), stride_kd=k.stride(3),
        stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vs=v.stride(2), stride_vd=v.stride(3),
        stride_mb=mstrides[0], stride_mh=mstrides[1], stride_mq=mstrides[2],
        stride_mk=mstrides[3], stride_ob=out.stride(0), stride_os=out.stride(1),
        QK_SCALE=scale * LOG2E,
        MASK=0 if mask is None else 1 if mask.dtype == torch.bool else 2,
        OUT=code, HAS_ZP=zero_point is not None and code == 1,
        Y_MANT=mant, Y_EMIN=emin, EXACT=interpreted, IEEE=q.dtype == torch.float32,
        BLOCK_M=sched.block_m, BLOCK_N=sched.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    grid = (triton.cdiv(S_Q, sched.block_m), B * H)
    return grid, args, dict(num_warps=sched.num_warps, num_stages=sched.num_stages), out


def attention(q, k, v, mask, scale, inv_scale, zero_point, out_dtype, interpreted, wrap=None,
              schedule=None) -> torch.Tensor:
    """The attention of [B, H, S, D] ``q``, ``k``, ``v`` as [B, S_Q, H*D] in ``out_dtype``
    (q's float dtype, int8 or fp8 e4m3; quantized with ``inv_scale`` and ``zero_point``).
    ``wrap``: ``torch.library.wrap_triton`` when traced. ``schedule``: an
    ``AttentionSchedule`` instead of the table's (benchmarks)."""
    grid, args, options, out = launch_args(q, k, v, mask, scale, inv_scale, zero_point,
                                           out_dtype, interpreted, schedule)
    kernel = wrap(_attention_kernel) if wrap is not None else _attention_kernel
    kernel[grid](**args, **options)
    return out
