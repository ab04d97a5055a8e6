"""Decode attention (flash-decoding) over a grouped-query KV cache, read in place.

    out[b, i, h, :] = softmax(q[b, h, i] @ k[b, h // G]^T * scale + mask[b, h, i])@ v[b, h // G]

q is [B, H, Sq, D] (Sq small: one decode token, or a few speculative ones), k and v are the
cache's [B, Hkv, L, D] over its full static length L, G = H // Hkv query heads share a kv head.
transformers' SDPA path first copies the cache G times (``repeat_kv``) per layer and step because
a mask is present; here each kv head's K/V tiles are read once and serve all G * Sq query rows of
that head as one ``tl.dot`` operand (rows padded to at least 16).

One program per (batch, kv head, split of L): at batch 1 there are only Hkv (batch, kv head)
pairs, far fewer than the GPU's multiprocessors, so L is split and each split keeps its own
online-softmax state (row max ``m`` in the log2 domain, row sum ``l``, unnormalized output) in a
float32 workspace. The last program of a (batch, kv head) to arrive (an arrival counter it resets
itself, as ``epilogue.split_k_reduce`` does for split-K GEMMs, so a CUDA-graph replay finds it
zeroed) combines the splits in split order (deterministic) and writes the output: one launch.

The mask is ``F.scaled_dot_product_attention``'s: boolean (True attends) or additive float,
broadcastable to [B, H, Sq, L], read with stride 0 over broadcast dims. A key is dropped where a
boolean mask is False or an additive mask is -inf; a row that drops every key gives 0 (SDPA's
safe softmax). A finite additive value, however negative (transformers' ``finfo.min``), is
added, so a row masked everywhere with it averages v, as SDPA does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qfuse.errors import DeviceError, ShapeError, UnsupportedError
from qfuse.kernels.attention.encoder import flash_tile

LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MAX_ROWS = 128  # G * Sq query rows one program holds (Llama-3-70B's G = 8 at Sq = 16)


@triton.jit
def _decode_attention_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, ws_ptr, lock_ptr,
    # dimensions
    HKV, SQ, L, D, CHUNK, SPLITS,
    # strides: q [B, H, Sq, D]; k, v [B, Hkv, L, D]; mask [B, H, Sq, L] (0 where broadcast);
    # out [B, Sq, H, D] contiguous
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_mb, stride_mh, stride_mq, stride_ml,
    # meta-parameters (the scale times log2 e is a constexpr: Inductor hands a Python float as
    # fp64, which would make the scores fp64)
    G: tl.constexpr,
    QK_SCALE: tl.constexpr,
    MASK: tl.constexpr,  # 0: none, 1: boolean (nonzero attends), 2: additive
    SPLIT: tl.constexpr,  # more than one split: partials through the workspace
    EXACT: tl.constexpr,  # interpreter: its dot reads bf16/fp16 operands as raw bits; upcast
    IEEE: tl.constexpr,  # float32 inputs: full-precision dots, not tf32
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bk = tl.program_id(0)  # b * HKV + kv head
    split = tl.program_id(1)
    b = (bk // HKV).to(tl.int64)  # a long cache's batch stride times b passes 2**31
    hk = bk % HKV
    rows = tl.arange(0, BLOCK_R)  # row r: query head hk * G + r // SQ, query position r % SQ
    head = hk * G + rows // SQ
    pos = rows % SQ
    row_ok = rows < G * SQ
    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if EXACT:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    m_base = mask_ptr + b * stride_mb + head[:, None] * stride_mh + pos[:, None] * stride_mq

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    for start in range(lo, hi, BLOCK_L):
        m_i, l_i, acc = flash_tile(
            q, start + offs_l, hi, row_ok, offs_d, d_ok, k_base, v_base, m_base,
            stride_kl, stride_kd, stride_vl, stride_vd, stride_ml, m_i, l_i, acc,
            QK_SCALE, MASK, EXACT, IEEE, 0, 0,
        )

    done = True
    if SPLIT:
        # Workspace per (b, kv head): [SPLITS, BLOCK_R] maxima, [SPLITS, BLOCK_R] sums,
        # [SPLITS, BLOCK_R, BLOCK_D] outputs, float32.
        ws = ws_ptr + bk * SPLITS * BLOCK_R * (BLOCK_D + 2)
        ws_l = ws + SPLITS * BLOCK_R
        ws_acc = ws + 2 * SPLITS * BLOCK_R
        tile = rows[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(ws + split * BLOCK_R + rows, m_i)
        tl.store(ws_l + split * BLOCK_R + rows, l_i)
        tl.store(ws_acc + split * BLOCK_R * BLOCK_D + tile, acc)
        # The barrier makes every thread's partial part of this program's release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + bk, 1, sem="acq_rel", scope="gpu")
        done = arrived == SPLITS - 1
        if done:
            m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_R], tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for s_ in range(0, SPLITS):  # fixed order: the same sums every run
                m_s = tl.load(ws + s_ * BLOCK_R + rows, cache_modifier=".cg")
                l_s = tl.load(ws_l + s_ * BLOCK_R + rows, cache_modifier=".cg")
                a_s = tl.load(ws_acc + s_ * BLOCK_R * BLOCK_D + tile, cache_modifier=".cg")
                m_new = tl.maximum(m_i, m_s)
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_sub)
                beta = tl.exp2(m_s - m_sub)
                l_i = l_i * alpha + l_s * beta
                acc = acc * alpha[:, None] + a_s * beta[:, None]
                m_i = m_new
            tl.atomic_xchg(lock_ptr + bk, 0)  # ready for the next launch (and graph replay)
    if done:
        # A row that kept no key: 0, as SDPA's safe softmax gives.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        y = tl.math.div_rn(acc, denom[:, None])
        H = HKV * G
        out = out_ptr + ((b * SQ + pos[:, None]) * H + head[:, None]) * D + offs_d[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---- schedule ----

@dataclass(frozen=True)
class DecodeSchedule:
    """Keys a program reads per step, warps, pipeline depth; ``splits``: a fixed split count
    (tests, benchmarks) instead of one that fills the GPU."""

    block_l: int = 64
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None


# Built once: a traced call (torch.compile, fullgraph) picks one, it constructs nothing.
# _SMALL: the fastest schedule of the sweep at TinyLlama's shape in 5 of its 6 rows (G = 8,
# D = 64; B 1 and 8, L 600 to 8192), 13% behind 64-key tiles at B = 8, L = 600
# (bench/decode_attention_ab.py --sweep, one H200). _BIG is not measured.
_SMALL = DecodeSchedule(block_l=128, num_warps=8, num_stages=3)
_BIG = DecodeSchedule(block_l=32, num_warps=8)


def default_schedule(rows: int, head_dim: int) -> DecodeSchedule:
    # Big row x head-dim tiles (G * Sq = 128 rows at D = 128) would spill at 4 warps.
    big = rows * max(16, triton.next_power_of_2(head_dim)) > 64 * 64
    return _BIG if big else _SMALL


def pick_splits(pairs: int, length: int, block_l: int, sms: int) -> tuple[int, int]:
    """(splits, keys per split): enough (batch, kv head, split) programs for two per
    multiprocessor, each split at least one ``block_l`` tile and a whole number of them."""
    tiles = triton.cdiv(max(length, 1), block_l)
    want = min(tiles, max(1, triton.cdiv(2 * sms, pairs)))
    chunk = triton.cdiv(tiles, want) * block_l
    return triton.cdiv(max(length, 1), chunk), chunk


# ---- launcher ----

@torch.compiler.assume_constant_result
def _sms(device: torch.device) -> int:
    """The device's multiprocessors; a constant to Dynamo (fullgraph compiles of the decode step
    need no trace through the cached device query)."""
    from qfuse.kernels.grid import sm_count

    return sm_count(device)


def check_inputs(q, k, v, mask) -> None:
    """Raise a typed error for inputs the kernel does not compute (named, with the fix)."""
    name = "decode_attention"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"{name}: q must be [B, H, Sq, D] and k, v [B, Hkv, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    B, H, Sq, D = q.shape
    if k.shape != v.shape[:3] + (k.shape[3],) or k.shape[0] != B:
        raise ShapeError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, "
                         f"kv heads and length, with q's batch {B}.")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ShapeError(f"{name}: q's {H} heads are not a multiple of k/v's {Hkv} kv heads; "
                         "pass the cache's [B, Hkv, L, D] tensors unrepeated, with H % Hkv == 0.")
    if k.shape[3] != D or v.shape[3] != D:
        raise UnsupportedError(f"{name}: head dims q {D}, k {k.shape[3]}, v {v.shape[3]}; the "
                               "kernel computes equal head dims (use SDPA otherwise).")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise UnsupportedError(f"{name}: head dim {D}; the kernel computes 1 to {MAX_HEAD_DIM}.")
    if (H // Hkv) * Sq > MAX_ROWS:
        raise UnsupportedError(f"{name}: {H // Hkv} query heads per kv head x {Sq} query "
                               f"positions = {(H // Hkv) * Sq} rows; the kernel holds up to "
                               f"{MAX_ROWS} (use SDPA for longer queries, e.g. prefill).")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"{name}: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}; give "
                               "one of float32, bfloat16, float16 for all three.")
    if not (q.device == k.device == v.device) or (mask is not None and mask.device != q.device):
        raise DeviceError(f"{name}: q, k, v and mask must be on one device; got {q.device}, "
                          f"{k.device}, {v.device}, {None if mask is None else mask.device}. "
                          "Move them to q's device.")
    if mask is not None:
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise UnsupportedError(f"{name}: mask dtype {mask.dtype}; give a boolean (True "
                                   "attends) or an additive float mask.")
        full = (B, H, Sq, k.shape[2])
        try:
            ok = mask.dim() <= 4 and tuple(torch.broadcast_shapes(mask.shape, full)) == full
        except RuntimeError:
            ok = False
        if not ok:
            raise ShapeError(f"{name}: mask {tuple(mask.shape)} does not broadcast to "
                             f"[B, H, Sq, L] = {[B, H, Sq, k.shape[2]]}.")


def decode_attention(q, k, v, mask, scale, interpreted, wrap=None, schedule=None, sms=None,
                     tracing=False) -> torch.Tensor:
    """The attention of [B, H, Sq, D] ``q`` over the [B, Hkv, L, D] cache ``k``, ``v`` as
    [B, Sq, H, D] in q's dtype. ``scale`` None: 1/sqrt(D). ``wrap``: ``torch.library.wrap_triton``
    when traced. ``sms``: multiprocessors to fill (the device's when None; 4 on CPU).
    ``tracing``: a compiled graph or CUDA-graph capture owns the counters (fresh zeros)."""
    from qfuse.kernels.grid import split_k_locks

    check_inputs(q, k, v, mask)
    B, H, Sq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    rows = G * Sq
    sched = schedule or default_schedule(rows, D)
    if sms is None:
        sms = _sms(q.device) if q.is_cuda else 4
    splits, chunk = pick_splits(B * Hkv, L, sched.block_l, sms)
    if sched.splits is not None:  # a fixed count, each split a whole number of tiles
        tiles = triton.cdiv(max(L, 1), sched.block_l)
        chunk = triton.cdiv(tiles, min(sched.splits, tiles)) * sched.block_l
        splits = triton.cdiv(max(L, 1), chunk)
    block_r = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(D))
    out = torch.empty((B, Sq, H, D), device=q.device, dtype=q.dtype)
    if splits > 1:
        ws = torch.empty(B * Hkv * splits * block_r * (block_d + 2), device=q.device,
                         dtype=torch.float32)
        locks = split_k_locks(q.device, B * Hkv, tracing) if q.is_cuda else torch.zeros(
            B * Hkv, device=q.device, dtype=torch.int32)
    else:
        ws = locks = out  # unread
    if mask is not None:
        mask = mask.expand(B, H, Sq, L)  # a view: stride 0 where broadcast
        mstrides = mask.stride()
    else:
        mstrides = (0, 0, 0, 0)
    scale = float(scale) if scale is not None else D ** -0.5
    kernel = wrap(_decode_attention_kernel) if wrap is not None else _decode_attention_kernel
    kernel[(B * Hkv, splits)](
        q, k, v, mask if mask is not None else out, out, ws, locks,
        Hkv, Sq, L, D, chunk, splits,
        *q.stride(), *k.stride(), *v.stride(), *mstrides,
        G=G, QK_SCALE=scale * LOG2E,
        MASK=0 if mask is None else 1 if mask.dtype == torch.bool else 2,
        SPLIT=splits > 1, EXACT=interpreted, IEEE=q.dtype == torch.float32,
        BLOCK_R=block_r, BLOCK_L=sched.block_l, BLOCK_D=block_d,
        num_warps=sched.num_warps, num_stages=sched.num_stages,
    )
    return out
