"""Schedules of the fused GEMM (``_qlinear_kernel``, its persistent form and the decode kernel):
``GemmConfig``, M buckets, and the candidate lists autotune chooses from per bucket — MMA
schedules for weight streaming and compute-bound sizes, the decode kernel's split-K and whole-K
schedules, heavy-epilogue tiles — with what limits them (shared memory, registers). Choosing
among them, the cache and the timing are ``tuning``'s.
"""

from __future__ import annotations

import dataclasses

import triton


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Float x: quantize in a separate pass first instead of in the GEMM's prologue.
    prequantize: bool = False
    # Run the epilogue on 1 or 2 column slices of the tile, one after the other: halves the
    # registers a heavy epilogue holds (GELU at 128x256: 30% faster); no gain at 128x128.
    epi_split: int = 1
    # One program per SM walking the tiles (``PERSISTENT`` of ``gemm.kernel._qlinear_kernel``);
    # no split-K.
    persistent: bool = False
    # Weight streaming without tensor cores (``DECODE``, see ``kernels/gemm/decode.py``): block_m
    # rows x block_n weight rows per program, no stages.
    decode: bool = False
    # x and W tiles loaded through TMA descriptors (``TMA``, ``kernels/gemm/tma.py``): x must be
    # quantized in memory first (a prequantize pass for float x); ``persistent`` walks tiles.
    tma: bool = False


# Decode batches get their own buckets below 16: the decode kernel computes every row of its
# block_m (no MMA padding to hide it), so M = 1 must not run a schedule sized for 16 rows.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Buckets up to this M stream weights (decode): autotune times them with a cold L2.
WEIGHT_STREAMING = 64
# The interpreter runs programs one by one in numpy: few, large programs are fastest there.
INTERPRETER_CONFIG = GemmConfig(block_m=32, block_n=64, block_k=128, num_stages=1)

def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    return M_BUCKETS[-1] * 2


def split_for(tiles: int, k_tiles: int, sms: int) -> int:
    """Smallest power-of-two split that gives at least one program per SM, each >= 4 K tiles."""
    split = 1
    while tiles * split < sms and k_tiles // (split * 2) >= 4:
        split *= 2
    return split


def candidates(M: int, N: int, K: int, kind: str, sms: int) -> list[GemmConfig]:
    """A handful of schedules for this M bucket, the expected best first.

    Measured on H200: quantizing a float x in the prologue re-does it in every column block — at
    M=16384, 4096x14336 int8 that took twice as long as with a separate quantize pass first; at
    M=16 the extra launch costs more than it saves. So float x gets the separate pass from
    M=128 on, and both are tried at M=64.
    """
    x_float = kind.endswith("xf")
    b = m_bucket(M)
    out = []
    if b <= DECODE_MAX_M:
        # The decode schedules (no MMA, see kernels/gemm/decode.py) first where they won (see
        # DECODE_FIRST_M); the MMA schedules stay in the list for autotune to compare.
        decode = decode_candidates(M, N, K, kind, sms)
        mma = _streaming_candidates(M, N, K, x_float, sms, short=True)
        first = b <= DECODE_FIRST_M and kind.startswith("int8")
        return decode + mma if first else mma + decode
    if b <= 64:
        return _streaming_candidates(M, N, K, x_float, sms)
    if b <= 256:
        for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (64, 256, 8)):
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
            split = split_for(tiles, triton.cdiv(K, 128), sms)
            for s in sorted({1, split}):
                out.append(GemmConfig(bm, bn, 128, split_k=s, num_warps=warps, num_stages=4,
                                      prequantize=x_float))
        # Narrow column tiles: at M = 128 an encoder's GEMMs (K, N of 384..3072) are bound by
        # reading the weights, and 64x128 tiles give MiniLM's FFN-up (N = 1536) 24 programs on
        # 132 SMs. 64x64 / 64x32 tiles give 2-4x the programs, each streaming its weight rows;
        # split-K (two K tiles a split at least) where still short.
        for bn in (64, 32):
            tiles = triton.cdiv(M, 64) * triton.cdiv(N, bn)
            k_tiles = triton.cdiv(K, 128)
            split = 1
            while tiles * split < sms and k_tiles // (split * 2) >= 2:
                split *= 2
            for s in sorted({1, split}):
                out.append(GemmConfig(64, bn, 128, split_k=s, num_warps=4, num_stages=3,
                                      prequantize=x_float))
        return out
    # Compute-bound: Inductor's best int8 template on H200 is 128x256x128, 3 stages, 8 warps;
    # 256x128 won as often here (1049 vs 1034 TOPS int8 at 16384x4096x14336).
    for bm, bn, bk, stages in ((128, 256, 128, 3), (256, 128, 128, 3), (128, 128, 128, 4),
                               (128, 256, 64, 4)):
        out.append(GemmConfig(bm, bn, bk, num_warps=8, num_stages=stages, prequantize=x_float))
    # Transformer-encoder shapes (K, N of 384..3072 at M of a few thousand tokens): the large
    # tiles above leave SMs idle (MiniLM's 4096x384x384 is 48 tiles of 256x128 on 132 SMs) and
    # their K loop is 3 iterations deep; measured on the H200, qfuse's GEMMs in MiniLM 32x128
    # took 1.7x cuBLAS bf16's time with only those. Smaller tiles fill the GPU.
    if N * K <= 4096 * 4096:
        # Timed by GPU time on the H200 (bench/encoder_gemms.py), 128x128x64 on one warpgroup
        # won 11 of BERT-base's 16 (layer, dtype) cases at M=4096: its 64 KB of
        # stages and 128 registers a thread leave room for two programs per SM, so one's
        # epilogue overlaps the other's MMAs.
        for bm, bn, bk, warps, stages, epi in ((128, 128, 64, 4, 4, 1), (128, 128, 64, 4, 3, 1),
                                               (128, 128, 64, 4, 4, 2), (64, 128, 128, 4, 4, 1),
                                               (128, 64, 128, 4, 4, 1), (64, 64, 128, 4, 4, 1)):
            out.append(GemmConfig(bm, bn, bk, num_warps=warps, num_stages=stages,
                                  prequantize=x_float, epi_split=epi))
        # Persistent (one program per SM walking the tiles): within 10% of the best on fp8 Q/K/V,
        # behind elsewhere (same measurement); kept as a candidate where it came closest.
        out.append(GemmConfig(128, 128, 128, num_warps=8, num_stages=4, prequantize=x_float,
                              persistent=True))
    if x_float and N <= 4096:
        # The prologue re-quantizes x once per column block: N / BLOCK_N times, few when N is
        # small, against a whole extra pass (and launch) over x for the separate quantize.
        # Timed by GPU time it lost at every encoder shape (BERT's attention output, N=768, by
        # half again; MiniLM's N=384 by a sixth), so only the two schedules that came closest
        # are kept in the prologue form.
        out += [dataclasses.replace(c, prequantize=False) for c in out[:3:2]]
    return out


def _streaming_candidates(M: int, N: int, K: int, x_float: bool, sms: int,
                          short: bool = False) -> list[GemmConfig]:
    """MMA schedules (``_qlinear_kernel``) for the weight-streaming buckets (M <= 64).
    ``short``: the first choice's split-K and twice it only, at most 6 (room for the decode
    kernel's candidates within the 16 a bucket may compile; fp8's tuned M = 1 picks on an
    H100 were all among the first 6)."""
    b = m_bucket(M)
    out = []
    # Weight streaming: a 16-row MMA wastes rows but the loop is bound by W bytes; wide K
    # blocks keep more bytes in flight per program, split-K fills the SMs.
    bm = max(16, b)
    shapes = ((64, 256, 4), (128, 256, 3), (128, 128, 5))
    if bm <= 32:  # 512-wide K tiles of a 64-row x overflow shared memory (262 KB > 227 KB)
        # 32-column tiles: twice the programs on the narrow decode GEMMs (N = 2048 is 32
        # tiles of 64 on 132 SMs) without deeper split-K reductions.
        shapes += ((64, 512, 3), (32, 512, 3), (32, 256, 4))
    pre = []
    for bn, bk, stages in shapes:
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        split = split_for(tiles, triton.cdiv(K, bk), sms)
        wide = bn == 32 or short
        splits = {split, split * 2} if wide else {split, max(1, split // 2), split * 2}
        for s in sorted(splits):
            if s == 1 or triton.cdiv(K, bk) // s >= 2:
                out.append(GemmConfig(bm, bn, bk, split_k=s, num_stages=stages))
        pre.append(GemmConfig(bm, bn, bk, split_k=split, num_stages=stages, prequantize=True))
    if short:
        out = out[:6]
    return out + pre if x_float and b == 64 else out


# The decode kernel's schedules as data: (block_n, block_k, num_warps), the expected best
# first (measured on an H100: 8x512 and 4x1024 are the fastest at M = 1, decode_ab_h100.txt).
# A program accumulates block_m x block_n x block_k/4 int32 lanes (int8 in dp4a words) or
# block_n x block_k (fp8 / odd-K int8, one row; more rows sum each step); block_k shrinks
# until a thread holds at most DECODE_LANES of them.
DECODE_SHAPES = ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (8, 1024, 8))
# Buckets up to DECODE_MAX_M get decode candidates; up to DECODE_FIRST_M they come first for
# int8 (fp8 keeps the MMA schedules first). Measured on an H100 (bench/decode_gemm_ab.py,
# TinyLlama shapes, cold L2), best decode schedule against the best MMA one:
# M = 1 int8 0.82-0.97x the time on all four shapes, fp8 0.90-1.31x (faster on one); M = 8
# int8 0.86-1.30x (faster on one), fp8 1.06-4.0x; M = 32 0.93-10x. Untuned calls take the
# first candidate, so the decode kernel leads only where it won: int8, M <= 2.
DECODE_MAX_M = 2
DECODE_FIRST_M = 2
DECODE_LANES = 32
# Programs to aim for per SM: a program keeps one block_n x block_k step in flight (plus the
# one it multiplies), so ~8 of 4-16 KB per SM keep several MB in flight on 132 SMs, what the
# H200's 4.8 TB/s at its memory latency needs.
DECODE_PROGRAMS_PER_SM = 8


# Whole-K schedules: a program reads its rows' whole K in one or two steps, both loads issued
# before it multiplies (decode_accumulate loads one step ahead), and sums no split-K partials.
# Profiled in TinyLlama's decode step on an H100 (bench/bench_llm.py, per GEMM position), the
# split-K schedules above streamed o_proj's 4 MB and down's 11.5 MB at a quarter and a third of
# the memory bandwidth: each program waits for ~3 loads in a row, then the
# split-K hand-off (a partial written, a counter, the last program reading them back), then the
# epilogue's loads, and every wait is a full memory latency. Lanes as above (DECODE_LANES a
# thread) decide the rows a program takes at each step count and warp count.
WHOLE_K_STEPS = (1, 2)
WHOLE_K_WARPS = (4, 8)


def whole_k_candidates(bm: int, K: int, words: bool) -> list[GemmConfig]:
    """Split-free decode schedules over ``WHOLE_K_STEPS`` K steps: block_k the next power of two
    of K over the steps; block_n the most rows whose lanes fit ``DECODE_LANES`` a thread (at most
    16; none below 2, which a gated epilogue's gate/up pair needs)."""
    out = []
    for steps in WHOLE_K_STEPS:
        bk = max(32, triton.next_power_of_2(K) // steps)
        lanes = bk // 4 if words or bm > 1 else bk
        for warps in WHOLE_K_WARPS:
            rows = DECODE_LANES * 32 * warps // (bm * lanes)
            if rows < 2:
                continue
            bn = min(16, 1 << (rows.bit_length() - 1))
            out.append(GemmConfig(bm, bn, bk, group_m=1, split_k=1, num_warps=warps,
                                  num_stages=1, decode=True))
    return out


def decode_candidates(M: int, N: int, K: int, kind: str, sms: int) -> list[GemmConfig]:
    """Decode schedules (``kernels/gemm/decode.py``) for this shape (``DECODE_SHAPES``):
    block_m the M bucket, at most 8 (larger M runs several row blocks, which re-read their
    weights from L2); split-K doubled until the GPU holds ``DECODE_PROGRAMS_PER_SM`` programs an
    SM while every split keeps at least one K step; the first shape also at half that split.
    Then the whole-K schedules (``whole_k_candidates``); 10 at most."""
    bm = min(m_bucket(M), 8)
    words = kind.startswith("int8") and K % 4 == 0
    out = []
    for i, (bn, bk, warps) in enumerate(DECODE_SHAPES):
        bk = min(bk, max(32, triton.next_power_of_2(K)))
        # Lane accumulators (int8 words, or one row) cap block_k; so do several rows' products
        # summed each step, at 4x the count (transient: fp8 8x16x512 spilled at 255 registers,
        # 8x8x512 took 167, compiled for sm_90). Every thread still loads at least 16 bytes of
        # W a step (one vector load), whatever the cap says.
        lanes = bk // 4 if words or bm > 1 else bk
        while (bk > 32 and bn * bk // 2 >= 16 * 32 * warps
               and bm * bn * lanes > DECODE_LANES * 32 * warps):
            bk //= 2
            lanes //= 2
        programs = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        k_tiles = triton.cdiv(K, bk)
        split = 1
        while programs * split < DECODE_PROGRAMS_PER_SM * sms and split * 2 <= k_tiles:
            split *= 2
        for s in (split, split // 2) if i == 0 and split > 1 else (split,):
            out.append(GemmConfig(bm, bn, bk, group_m=1, split_k=s, num_warps=warps,
                                  num_stages=1, decode=True))
    if kind.endswith("xf"):
        # Float x is quantized by every program for the columns it reads (~13 operations an
        # element, shared by only block_n weight rows): the first shape once more with a
        # separate quantize pass (after which int8 x is read as words).
        out.insert(1, dataclasses.replace(out[0], prequantize=True))
    out = list(dict.fromkeys(out))[:6]
    out += [c for c in whole_k_candidates(bm, K, words) if c not in out]
    return out[:10]


def for_epilogue(cfg: GemmConfig, heavy: bool) -> GemmConfig:
    """``cfg`` for a heavy epilogue: the tile capped at 128x128 (8 warps, 4 stages).

    Measured on H200 (bench/epilogue_ab.py, M=16384 K=4096 N=14336, int8 out): GELU at
    128x256 took 2.8x ReLU's time, 2x in two column halves (``epi_split=2``), 1.5x at 128x128
    (the same in halves). fp8: GELU at 128x128 in less than half the time of 128x256.
    """
    if heavy and cfg.block_m * cfg.block_n > 128 * 128:
        return dataclasses.replace(cfg, block_m=128, block_n=128, block_k=128, num_warps=8,
                                   num_stages=4, epi_split=1)
    return cfg


def fits(cfg: GemmConfig, kind: str, x_bytes: int = 2) -> bool:
    """Whether the pipelined tiles fit in shared memory with room to spare (200 of the 227 KB a
    Hopper block may have): a float x quantized in the prologue is staged at its own width."""
    if cfg.decode:  # registers only (decode_candidates sized them), no shared-memory stages
        return True
    a_bytes = x_bytes if kind.endswith("xf") and not cfg.prequantize else 1
    stage = cfg.block_m * cfg.block_k * a_bytes + cfg.block_k * cfg.block_n
    return cfg.num_stages * stage <= 200 * 1024


def runnable_candidates(M: int, N: int, K: int, kind: str, sms: int, heavy_epilogue: bool,
                        x_bytes: int = 2) -> list[GemmConfig]:
    """``candidates`` as they will run: capped for a heavy epilogue (``for_epilogue``), and only
    schedules that fit (a candidate that fails to launch is skipped by autotune, but an untuned
    pick must run)."""
    cands = [for_epilogue(c, heavy_epilogue) for c in candidates(M, N, K, kind, sms)]
    if heavy_epilogue and m_bucket(M) > WEIGHT_STREAMING:
        cands += heavy_candidates(kind.endswith("xf"))
    cands += [for_epilogue(c, heavy_epilogue) for c in tma_candidates(M, N, K, kind.endswith("xf"))]
    cands = list(dict.fromkeys(cands))
    return [c for c in cands if fits(c, kind, x_bytes)] or cands


# TMA schedules (``kernels/gemm/tma.py``) for the MMA buckets: (block_m, block_n, block_k,
# num_warps, num_stages, persistent, epi_split).
TMA_SHAPES = (
    (128, 128, 128, 8, 3, False, 1), (128, 128, 128, 8, 4, True, 1),
    (128, 128, 64, 4, 4, False, 1), (128, 128, 64, 4, 4, True, 1),
    (128, 256, 128, 8, 3, False, 1), (128, 256, 128, 8, 3, True, 1),
    (128, 256, 64, 8, 4, True, 2), (64, 128, 128, 4, 4, False, 1),
    (128, 64, 128, 4, 4, False, 1), (256, 128, 128, 8, 3, True, 1),
    (128, 128, 128, 4, 3, False, 1), (64, 256, 128, 4, 3, False, 1),
    # Two stages: more programs an SM, so one program's epilogue runs beside another's MMAs
    # (short K leaves few steps to pipeline anyway).
    (128, 128, 128, 4, 2, False, 1), (128, 128, 128, 4, 2, True, 1),
    (64, 128, 128, 4, 3, False, 1), (64, 128, 128, 4, 2, False, 1),
)


def tma_candidates(M: int, N: int, K: int, x_float: bool) -> list[GemmConfig]:
    """TMA schedules for a compute-bound bucket; none where a descriptor cannot read the
    operands (a row pitch of K bytes must be a multiple of 16)."""
    if m_bucket(M) <= WEIGHT_STREAMING or K % 16:
        return []
    return [GemmConfig(bm, bn, bk, num_warps=w, num_stages=st, prequantize=x_float,
                       epi_split=epi, persistent=p, tma=True)
            for bm, bn, bk, w, st, p, epi in TMA_SHAPES]


def heavy_candidates(x_float: bool) -> list[GemmConfig]:
    """Schedules for a heavy epilogue (GELU, SiLU, gated) at any size, after the capped ones.

    Above 4096 x 4096 weights ``candidates`` offers only tiles larger than 128x128, which
    ``for_epilogue`` all caps to the same 128x128x128 schedule on 8 warps: autotune had one
    choice. On an H100 TinyLlama's gate/up GEMM with its SwiGLU epilogue (M 512, N 11264,
    K 2048) ran that schedule at 260 TOPS, two thirds of the quantized GEMMs' time in a 1x512
    prefill. One-warpgroup tiles hold half the
    registers, so two programs share an SM and one's epilogue overlaps the other's MMAs (they
    won BERT-base's GELU FFN, ``candidates``); autotune now times them too."""
    return [GemmConfig(bm, bn, bk, num_warps=4, num_stages=stages, prequantize=x_float,
                       epi_split=epi)
            for bm, bn, bk, stages, epi in ((128, 128, 64, 4, 1), (128, 128, 64, 3, 1),
                                            (128, 128, 64, 4, 2), (64, 128, 128, 4, 1))]
