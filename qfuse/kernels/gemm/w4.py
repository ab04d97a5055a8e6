"""The 4-bit-weight GEMM, W4A16 and W4A8, with the fused GEMM's epilogue in the same launch.

    part_g[m, n] = sum_{k in group g} x[m, k] * (q[n, k] - zero[n, g])   (W4A16: float32;
                                                                           W4A8: int32, exact)
    acc[m, n]    = sum_g part_g[m, n] * scale[n, g]                       (float32, group order)
    out          = finish_tile(acc)    (``epilogue``: [x_scale,] bias, act, residual, out dtype)

The weight stays in its stored layout (``qfuse.int4``: eight codes per int32 along K as
``q + 8``, compressed-tensors' ``pack_quantized``). A K step of ``BLOCK_K`` columns loads each
weight row's ``BLOCK_K / 8`` words once, as one contiguous [BLOCK_N, BLOCK_K / 8] tile (16-byte
loads per thread where the tile is large enough), and unpacks them in registers by shifts. Every
K step lies inside one scale group (the launcher makes ``BLOCK_K`` divide the group size, or the
row is one group), so the loop sums unscaled codes (``q - zero`` is exact in float32, bf16 and
int8) and multiplies by a group's scale once per step or group: no per-weight scale multiply.
W4A8's sums are the reference's (``ops.w4linear.gemm_reference``: an exact int32 sum per group,
scaled and added in float32 in group order, then the x scale), so without split-K its outputs
are bit-identical to it.

Two schedules, constexpr ``DECODE``:

- tiles (M > 4 for W4A16, > 16 for W4A8): one program per [BLOCK_M, BLOCK_N] output tile,
  tensor-core ``tl.dot``s on the words unpacked to [BLOCK_N, BLOCK_K] (``_nibbles``: three
  ``tl.join``s, so each thread unpacks the words it loaded; the first version's 3-D reshape made
  ptxas spill): W4A16 multiplies x in its own dtype by the codes in that dtype (exact:
  |q - zero| <= 15) into a float32 group sum, scaled when the group ends; W4A8 multiplies int8 x
  by the int8 codes into an int32 group sum.
- ``DECODE`` (weight streaming as ``decode.py``): no tensor cores, no reshapes; a program owns
  ``BLOCK_N`` whole weight rows and ``BLOCK_M`` x rows and works in the words' own
  [.., BLOCK_N, BLOCK_K / 8] shape: code ``j`` of every word (a shift and a mask) against x's
  column ``8 w + j`` (eight strided loads of a few-KB x, L1-resident), accumulated lane-wise
  (one lane per word position) and summed across threads once, after the loop. The next K
  step's words are loaded before this step's products, and (programmatic dependent launch) the
  first step's before ``pdl_wait``. W4A16: ``2**23 + nibble`` as a float32 (``| 0x4B000000``)
  minus ``2**23 + 8 + zero`` is ``q - zero`` exactly (no int-to-float conversion); a word's 8
  products are summed in its thread and scaled per word (one multiply per 8 weights). W4A8:
  ``dp4a`` on a word's even and odd nibbles masked into two words of four bytes
  (``& 0x0F0F0F0F``) against x's even and odd columns packed the same way: two ``dp4a`` per
  eight codes and row; the ``8 + zero`` offset is subtracted as ``(8 + zero) * sum(x)`` when
  the group's integer lanes are summed (exact).

Both split along K (``SPLIT_K``, grid axis 1) when the grid is small: the tile's last program
sums the float32 partials in split order (``epilogue.split_k_reduce``: deterministic). A split
boundary inside a group scales that group's two partial sums separately (float32 rounding;
``pick_config`` splits at group boundaries when it can).

W4A8 x: float with a static per-tensor scale, quantized in the prologue (``quantize_int8``, the
reference's rounding; by a pass of its own for the decode schedule beyond 4 rows); or per token,
quantized by ``quantize.quantize``'s pass (the scale of a row needs the whole row) and scaled
per row in the epilogue (``X_ROW_SCALE``). The epilogue's per-column scale is a vector of ones
(``_ones``): the group scales are applied in the loop.

Launched with Triton's default float contraction (the W4A16 loop wants its FMAs): every product
whose rounding the reference fixes (the W4A8 group sums, the epilogue) is an explicit ``mul_rn``.

Host side: ``W4Config`` (a schedule), ``pick_config`` (M bucket -> schedule), ``w4_args`` /
``w4_gemm`` (one launch). ``ops.w4linear`` registers it as the ``qfuse::w4linear`` custom op
(opaque to ``torch.compile``, so its programmatic dependent launch survives tracing; CUDA graphs
capture its launches).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.common import (
    ACTIVATION_CODES,
    GATED_ACTIVATIONS,
    INTERPRETED,
    INTERPRETED_JIT,
    mul_rn,
    out_features,
    pdl_wait,
    quantize_int8,
    tile_offsets,
)
from qfuse.kernels.epilogue import finish_tile, float_grid, k_range, split_k_reduce
from qfuse.kernels.gemm.decode import _w_step, dp4a

# (8 + nibble) codes of a float32 ``2**23 + nibble`` (``nibble | 0x4B000000`` bit-cast)
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC_BIAS = tl.constexpr(8388616.0)  # 2**23 + 8
LO_NIBBLES = tl.constexpr(0x0F0F0F0F)


@triton.jit
def _nibbles3(words):
    """int32 words [R, BKW] -> their nibbles ``q + 8`` int32 [R, BKW, 8]: ``[r, w, j]`` is
    bits ``4 j .. 4 j + 3`` of word ``w``, column ``8 w + j`` (``int4.pack``).

    Built by ``tl.join``s, which add a dimension held inside each thread, so a thread unpacks
    the words it loaded and nothing moves between threads. Three joins give [R, BKW, 2, 2, 2],
    read as ``4 a + 2 b + c``; the leaf at tree position ``(c, b, a)`` (the last join's index
    outermost) is therefore nibble ``4 a + 2 b + c``."""
    n0 = words & 0xF
    n1 = (words >> 4) & 0xF
    n2 = (words >> 8) & 0xF
    n3 = (words >> 12) & 0xF
    n4 = (words >> 16) & 0xF
    n5 = (words >> 20) & 0xF
    n6 = (words >> 24) & 0xF
    n7 = (words >> 28) & 0xF
    tree = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                   tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    return tl.reshape(tree, (words.shape[0], words.shape[1], 8))


@triton.jit
def _nibbles(words, BLOCK_K: tl.constexpr):
    """``_nibbles3`` as [R, BLOCK_K] (column ``8 w + j``)."""
    return tl.reshape(_nibbles3(words), (words.shape[0], BLOCK_K))


@triton.jit(do_not_specialize=["M"])
def _w4_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, z_ptr, x_scale_ptr, x_inv_scale_ptr, ones_ptr, bias_ptr, res_ptr,
    out_ptr, ws_ptr, lock_ptr,
    # dimensions (KW: words per weight row; GROUP: columns per scale group)
    M, N, K, KW, GROUP,
    # strides (the weight's words, scales' and zero points' groups are contiguous)
    stride_xm, stride_xk, stride_wn, stride_sn, stride_rm, stride_rn, stride_om, stride_on,
    # meta-parameters: numerics
    A8: tl.constexpr,
    X_QUANTIZED: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_MANT: tl.constexpr,
    OUT_EMIN: tl.constexpr,
    EXACT: tl.constexpr,
    FAST_ACT: tl.constexpr,
    IEEE: tl.constexpr,
    # meta-parameters: schedule
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DECODE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """x [M, K] (float; W4A8 per token: int8), w int32 [N, KW], s float32 [N, G], z int8
    [N, G] -> out [M, N] (gated: [M, N / 2]). Program ``(pid, s)``: output tile ``pid`` over
    the ``s``-th of ``SPLIT_K`` K ranges."""
    pid = tl.program_id(0)
    if DECODE:
        # the row blocks of one column block are neighbours in launch order (W shared in L2)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_n = pid // num_m
        offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        offs_m, offs_n, _, pid_n = tile_offsets(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    cols = tl.where(offs_n < N, offs_n, 0)  # columns past N read row 0; the store drops them
    k_first, k_end = k_range(K, BLOCK_K, SPLIT_K)
    BKW: tl.constexpr = BLOCK_K // 8
    offs_kw = tl.arange(0, BKW)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None] * stride_wn + (k_first * BKW + offs_kw)[None, :]
    w_next = _w_step(w_ptrs, k_first, k_end, offs_kw, KW, BKW, EVEN_K, 0)
    pdl_wait(PDL)  # the weights do not depend on the kernel before; x and the rest may
    x_inv = 1.0
    if A8 and not X_QUANTIZED:
        x_inv = tl.load(x_inv_scale_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if A8 else tl.float32)
    if DECODE:
        # lanes: one per (row, column, word of the step), summed across threads once at the end
        # (W4A8: per group, the integer sum must be whole before its scale)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BKW), dtype=tl.int32 if A8 else tl.float32)
    if DECODE and A8:
        xsum = tl.zeros((BLOCK_M, BKW), dtype=tl.int32)  # lane-wise sums of x, as acc3
    for k in range(k_first, k_end):
        words = w_next
        w_ptrs += BKW
        w_next = _w_step(w_ptrs, k + 1, k_end, offs_kw, KW, BKW, EVEN_K, 0)
        g = (k * BLOCK_K) // GROUP
        if HAS_ZP:
            zero = tl.load(z_ptr + cols * stride_sn + g).to(tl.int32)
        else:
            zero = tl.zeros((BLOCK_N,), dtype=tl.int32)
        if DECODE:
            # Everything in the words' [.., BKW] shape (no reshapes: each thread works on the
            # words it loaded): code j of every word against x's column 8 w + j, loaded strided
            # (x is a few KB, in L1 after the first program).
            x_row = x_ptr + offs_m[:, None] * stride_xm
            col0 = k * BLOCK_K + offs_kw * 8
            if A8:
                # x's even / odd columns of each word as four int8 bytes (dp4a's operands)
                xe = tl.zeros((BLOCK_M, BKW), dtype=tl.int32)
                xo = tl.zeros((BLOCK_M, BKW), dtype=tl.int32)
                for i in tl.static_range(8):
                    col = col0 + i
                    xv = tl.load(x_row + col[None, :] * stride_xk,
                                 mask=mask_m[:, None] & (col < K)[None, :], other=0.0)
                    if not X_QUANTIZED:
                        xv = quantize_int8(xv.to(tl.float32), x_inv, 0.0, False)
                    xv = xv.to(tl.int32)
                    xsum += xv
                    if i % 2 == 0:
                        xe = xe | ((xv & 0xFF) << (8 * (i // 2)))
                    else:
                        xo = xo | ((xv & 0xFF) << (8 * (i // 2)))
                lo = words & LO_NIBBLES  # codes 0, 2, 4, 6 of each word as bytes
                hi = (words >> 4) & LO_NIBBLES  # codes 1, 3, 5, 7
                shape: tl.constexpr = (BLOCK_M, BLOCK_N, BKW)
                acc3 = dp4a(tl.broadcast_to(xe[:, None, :], shape),
                            tl.broadcast_to(lo[None, :, :], shape), acc3)
                acc3 = dp4a(tl.broadcast_to(xo[:, None, :], shape),
                            tl.broadcast_to(hi[None, :, :], shape), acc3)
            else:
                # q - zero, exactly: 2**23 + nibble as a float32, minus 2**23 + 8 + zero; a
                # word's 8 products summed in its thread, then scaled by the step's group scale
                # (one multiply per word, no cross-thread sum per step)
                offset = (zero.to(tl.float32) + MAGIC_BIAS)[:, None]
                t = tl.zeros((BLOCK_M, BLOCK_N, BKW), dtype=tl.float32)
                for j in tl.static_range(8):
                    col = col0 + j
                    xv = tl.load(x_row + col[None, :] * stride_xk,
                                 mask=mask_m[:, None] & (col < K)[None, :], other=0.0)
                    qj = ((((words >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)
                          - offset)
                    t += xv.to(tl.float32)[:, None, :] * qj[None, :, :]
                scale = tl.load(s_ptr + cols * stride_sn + g)
                acc3 += t * scale[None, :, None]
        else:
            kk = k * BLOCK_K + offs_k
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
            if A8:
                if not X_QUANTIZED:
                    a = quantize_int8(a.to(tl.float32), x_inv, 0.0, False)
                b = (_nibbles(words, BLOCK_K) - (8 + zero)[:, None]).to(tl.int8)
                part = tl.dot(a.to(tl.int8), tl.trans(b), part, out_dtype=tl.int32)
            else:
                offset = zero.to(tl.float32) + MAGIC_BIAS
                q = ((_nibbles(words, BLOCK_K) | MAGIC_BITS).to(tl.float32, bitcast=True)
                     - offset[:, None])
                if IEEE or INTERPRETED_JIT:
                    # float32 x; and the interpreter, whose bf16 dot is wrong (triton 3.7):
                    # codes and x are exact in float32 either way
                    part = tl.dot(a.to(tl.float32), tl.trans(q), part, input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(q.to(a.dtype)), part)
        # ---- the group ends here (or this program's K range does): scale its sum once ----
        if A8 or not DECODE:
            if (((k + 1) * BLOCK_K) % GROUP == 0) | (k + 1 == k_end):
                scale = tl.load(s_ptr + cols * stride_sn + g)
                if A8:
                    if DECODE:
                        # the codes' 8 + zero offset: (8 + zero) * sum(x), exact
                        part = tl.sum(acc3 - (8 + zero)[None, :, None] * xsum[:, None, :],
                                      axis=2)
                        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BKW), dtype=tl.int32)
                        xsum = tl.zeros((BLOCK_M, BKW), dtype=tl.int32)
                    acc = acc + mul_rn(part.to(tl.float32), scale[None, :])
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                else:
                    acc = acc + mul_rn(part, scale[None, :])
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DECODE and not A8:
        acc = tl.sum(acc3, axis=2)
    # ---- split-K: park the partial sum; the tile's last program reduces and goes on ----
    is_last = True
    if SPLIT_K > 1:
        acc, is_last = split_k_reduce(acc, offs_m, offs_n, M, N, ws_ptr, lock_ptr + pid, SPLIT_K)
    if is_last:
        if A8 and not X_ROW_SCALE:
            acc = mul_rn(acc, tl.load(x_scale_ptr))  # the static input scale, the reference's
        finish_tile(
            acc, offs_m, pid_n, M, N,
            ones_ptr, x_scale_ptr, bias_ptr, ones_ptr, ones_ptr, res_ptr, ones_ptr, ones_ptr,
            out_ptr, stride_rm, stride_rn, stride_om, stride_on,
            X_ROW_SCALE, False, HAS_BIAS, ACT, HAS_RESIDUAL, 0, False,
            OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, 1,
        )


# ---------------------------------------------------------------- host side


@dataclasses.dataclass(frozen=True)
class W4Config:
    """A schedule of ``_w4_kernel``: tile sizes, split-K, warps, stages, and ``decode`` (the
    weight-streaming schedule, no tensor cores). ``block_k`` is an upper bound: the launch
    shrinks it to a power of two dividing the group size when a row has several groups."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    decode: bool = True


DECODE_MAX_M = 16
INTERPRETER_SMS = 8  # the interpreter's "GPU": split-K rules see a small one


def _pow2_divisor(n: int) -> int:
    return n & -n


def step_k(cfg: W4Config, K: int, group_size: int | None) -> int:
    """The K step a launch uses: ``cfg.block_k``, shrunk to divide the group size when a row
    has several groups (4-bit group sizes are multiples of 8, so at least 8)."""
    bk = cfg.block_k
    if group_size is not None and group_size < K:
        bk = min(bk, _pow2_divisor(group_size))
    return bk


def _split(tiles: int, k_steps: int, group_steps: int, sms: int, per_sm: int) -> int:
    """Smallest power-of-two split giving ``per_sm`` programs per SM, each with >= 2 K steps;
    with several groups a row, only splits whose ranges end at group boundaries."""
    split = 1
    while tiles * split < sms * per_sm and k_steps // (split * 2) >= 2:
        per_split = -(-k_steps // (split * 2))
        if group_steps < k_steps and per_split % group_steps:
            break
        split *= 2
    return split


def pick_config(M: int, N: int, K: int, group_size: int | None, act_bits: int,
                device: torch.device, sms: int | None = None) -> W4Config:
    """The schedule for an [M, K] x [N, K] 4-bit GEMM (defaults for an H100/H200, untuned):

    - weight streaming (``decode``) for M <= 4: K steps of 128 columns (64 bytes of a row; g64
      halves them), 32 weight rows per program (16 for 2..4 rows of W4A16, whose per-step
      registers grow with rows x columns), so that a step's
      [BLOCK_N, BLOCK_K / 8] words give each of the 128 threads a 16-byte load; split-K to ~4
      programs per SM;
    - tensor-core tiles otherwise: 16x64x128 with 4 warps up to M = 16 (a weight stream
      through the MMA, split-K to ~2 programs per SM), then 32x64x128 and 64x64x64 with 8
      warps (the group's float32 partial sum lives beside the accumulator: with 4 warps a
      64x64 tile took all 255 registers), 3 stages, split-K only where the tiles leave SMs
      idle.

    Register counts from ptxas for sm_90 (no GPU needed: ``triton.compile`` with a
    ``GPUTarget``), none spilling: decode M = 1 32x128 80, tiles 16x64x128 108, 32x64x128/8
    warps 170, 64x64x64/8 warps 168. On an H200, TinyLlama's 88 decode GEMMs at M = 1 take
    857 us with these picks, 0.55x int8 (bench/results/current/h200/w4_chain.json)."""
    bm = min(triton.next_power_of_2(max(M, 1)), 16)
    if M <= 4:
        # W4A16 sums each step's [BM, BN, BK] products (one row: lane-wise): 16 rows for 2..4.
        # W4A8 stops at 4 rows too: its 16-row decode took 5031 us for TinyLlama's 88 GEMMs on
        # an H200, 6x int8 (bench/results/current/h200/w4_chain.json)
        cfg = W4Config(bm, 32 if bm <= (4 if act_bits == 8 else 1) else 16, 128, 1, 4, 1,
                       True)
    elif M <= DECODE_MAX_M:
        cfg = W4Config(16, 64, 128, 1, 4, 3, False)
    else:
        cfg = W4Config(32, 64, 128, 1, 8, 3, False) if M <= 32 else \
            W4Config(64, 64, 64, 1, 8, 3, False)
    return with_split(cfg, M, N, K, group_size, device, sms)


def with_split(cfg: W4Config, M: int, N: int, K: int, group_size: int | None,
               device: torch.device, sms: int | None = None) -> W4Config:
    """``cfg`` with the split-K that fills the GPU (``sms`` multiprocessors: the device's by
    default): ~4 programs per SM for the decode schedule, 2 for tiles up to M = 16, 1 beyond
    (``_split``)."""
    if sms is not None:
        pass
    elif device.type == "cuda" and not INTERPRETED:
        from qfuse.kernels.grid import sm_count

        sms = sm_count(device)
    else:
        sms = INTERPRETER_SMS
    per_sm = 4 if cfg.decode else (2 if M <= DECODE_MAX_M else 1)
    bk = step_k(cfg, K, group_size)
    k_steps = -(-K // bk)
    group_steps = group_size // bk if group_size is not None and group_size < K else k_steps
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    return dataclasses.replace(cfg, split_k=_split(tiles, k_steps, group_steps, sms, per_sm))


# A vector of float32 ones per device: the epilogue's per-column scale (the group scales are
# applied in the main loop). Grown as needed, outside CUDA-graph capture.
_ONES: dict[torch.device, torch.Tensor] = {}


def _ones(device: torch.device, n: int, capturing: bool) -> torch.Tensor:
    ones = _ONES.get(device)
    if ones is not None and ones.numel() >= n:
        return ones
    if capturing:  # a graph being captured owns what it allocates: its own, uncached
        return torch.ones(n, device=device, dtype=torch.float32)
    ones = torch.ones(max(n, 1 << 15), device=device, dtype=torch.float32)
    _ONES[device] = ones
    return ones


def _locks(device: torch.device, tiles: int, capturing: bool) -> torch.Tensor:
    from qfuse.kernels import grid

    cached = grid._LOCKS.get(device)
    fresh = capturing and (cached is None or cached.numel() < tiles)
    return grid.split_k_locks(device, tiles, fresh)


def check_call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               zero: torch.Tensor | None, in_features: int, group_size: int | None,
               act: str, act_bits: int) -> None:
    M, K = x.shape
    N = weight.shape[0]
    G = -(-K // (group_size or K))
    if K != in_features or weight.dtype != torch.int32 or weight.shape[1] != -(-K // 8):
        raise ShapeError(f"w4 gemm: x has {K} features, the layer {in_features}; the packed "
                         f"weight is {weight.dtype} {tuple(weight.shape)} (want int32 "
                         f"[N, {-(-K // 8)}]).")
    if scale.shape != (N, G) or (zero is not None and zero.shape != (N, G)):
        raise ShapeError(f"w4 gemm: scales {tuple(scale.shape)} / zero points "
                         f"{None if zero is None else tuple(zero.shape)} for {N} rows of "
                         f"{G} groups of {group_size or K}.")
    if act_bits not in (8, 16):
        raise UnsupportedError(f"w4 gemm: act_bits={act_bits}; 16 (W4A16) or 8 (W4A8).")
    if act not in ACTIVATION_CODES:
        raise UnsupportedError(f"w4 gemm: activation {act!r} has no epilogue kernel.")
    if act in GATED_ACTIVATIONS and N % 2:
        raise ShapeError(f"w4 gemm: a gated activation needs an even number of rows, got {N}.")


def w4_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor | None, bias: torch.Tensor | None, in_features: int,
            group_size: int | None, act: str = "none", act_bits: int = 16,
            x_scale: torch.Tensor | None = None, x_inv_scale: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            config: W4Config | None = None) -> tuple:
    """``(out, grid, arguments by name, launch options)`` of ``w4_gemm``'s launch (after the
    per-token quantize pass, which it runs); ``grid`` None when there is nothing to launch."""
    from qfuse.kernels.grid import pdl
    from qfuse.kernels.quantize import quantize

    check_call(x, weight, scale, zero, in_features, group_size, act, act_bits)
    M, K = x.shape
    N = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    out = torch.empty((M, out_features(N, act)), device=x.device, dtype=out_dtype)
    if M == 0:
        return out, None, {}, {}
    cfg = config or pick_config(M, N, K, group_size, act_bits, x.device)
    bk = step_k(cfg, K, group_size)
    if config is None and not cfg.decode and x.dtype == torch.float32 and act_bits == 16:
        # an IEEE float32 dot runs on CUDA-core FMAs: a 64x64 tile spilled ~10 KB (ptxas)
        cfg = dataclasses.replace(cfg, block_m=min(cfg.block_m, 32),
                                  block_n=min(cfg.block_n, 32), block_k=min(cfg.block_k, 32))
        bk = step_k(cfg, K, group_size)
    if not cfg.decode and bk < (32 if act_bits == 8 else 16):
        # groups of 8 or 24 columns (a K step of 8) are below a tensor-core dot's K: the
        # CUDA-core schedule serves them
        cfg = dataclasses.replace(cfg, block_m=min(cfg.block_m, DECODE_MAX_M), decode=True)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    dev = x.device
    per_token = act_bits == 8 and x_inv_scale is None
    row_scale = None
    x_quantized = per_token
    if per_token:
        x, row_scale = quantize(x, torch.int8, None, None, INTERPRETED)
    elif act_bits == 8 and x_scale is None:
        raise UnsupportedError("w4 gemm: a static W4A8 input scale needs x_scale with "
                               "x_inv_scale.")
    elif act_bits == 8 and cfg.decode and M > 4:
        # the decode schedule quantizes each x element once per program (shared by BLOCK_N
        # rows): from a few rows on, one pass first costs less (the same rounding)
        x, _ = quantize(x, torch.int8, x_inv_scale, None, INTERPRETED)
        x_quantized = True
    scale = scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    weight = weight.contiguous()
    ones = _ones(dev, N, capturing)
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    ws = locks = ones
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, M, N), device=dev, dtype=torch.float32)
        locks = _locks(dev, tiles, capturing)
    res = residual if residual is not None else out
    grid_bits = float_grid(out_dtype)
    use_pdl = cfg.decode and pdl(dev)
    args = dict(
        x_ptr=x, w_ptr=weight, s_ptr=scale, z_ptr=zero if zero is not None else ones,
        x_scale_ptr=row_scale if per_token else (x_scale if x_scale is not None else ones),
        x_inv_scale_ptr=x_inv_scale if x_inv_scale is not None else ones, ones_ptr=ones,
        bias_ptr=bias if bias is not None else ones, res_ptr=res, out_ptr=out, ws_ptr=ws,
        lock_ptr=locks,
        M=M, N=N, K=K, KW=weight.shape[1], GROUP=group_size or K,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wn=weight.stride(0),
        stride_sn=scale.stride(0), stride_rm=res.stride(0), stride_rn=res.stride(1),
        stride_om=out.stride(0), stride_on=out.stride(1),
        A8=act_bits == 8, X_QUANTIZED=x_quantized, X_ROW_SCALE=per_token,
        HAS_ZP=zero is not None, HAS_BIAS=bias is not None, ACT=ACTIVATION_CODES[act],
        HAS_RESIDUAL=residual is not None, OUT_MANT=grid_bits[0], OUT_EMIN=grid_bits[1],
        EXACT=INTERPRETED, FAST_ACT=False, IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=8,
        SPLIT_K=cfg.split_k, DECODE=cfg.decode, EVEN_K=K % bk == 0, PDL=use_pdl,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if use_pdl:
        options["launch_pdl"] = True
    return out, (tiles, cfg.split_k), args, options


def w4_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor | None, bias: torch.Tensor | None, in_features: int,
            group_size: int | None, act: str = "none", act_bits: int = 16,
            x_scale: torch.Tensor | None = None, x_inv_scale: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            config: W4Config | None = None) -> torch.Tensor:
    """``epilogue(x @ W4^T)`` for 2-D x [M, K] in one launch (two for per-token W4A8: the
    quantize pass first), the semantics of ``ops.w4linear`` (see its docstring): the packed
    ``weight`` int32 [N, ceil(K / 8)], group ``scale`` float32 [N, G] and ``zero`` int8 [N, G]
    (``qfuse.int4``), ``bias`` [N], activation ``act`` (gated: interleaved [gate, up] rows),
    ``residual`` [M, N_out], out in ``out_dtype`` (default x's). W4A8 (``act_bits=8``): x
    quantized with the static ``x_inv_scale`` (then ``x_scale`` is its scale) or per token when
    None. ``config`` pins a schedule (``pick_config`` otherwise)."""
    out, grid, args, options = w4_args(x, weight, scale, zero, bias, in_features, group_size,
                                       act, act_bits, x_scale, x_inv_scale, residual,
                                       out_dtype, config)
    if grid is not None:
        _w4_kernel[grid](**args, **options)
    return out
