"""The decode schedule (``kernels/gemm/decode.py``, ``DECODE`` of ``_qlinear_kernel``) against the
reference, as in test_qgemm: int8 bit-exact, fp8 within its float32 accumulation.

Shapes cover M = 1 and a few rows over several row blocks, odd N (a partial column block,
gated pairs cut at the edge), odd K (the byte path) and K % 4 == 0 (int8 read as dp4a words),
K tails, split-K with uneven and empty splits, and two calls in a row (counters reset)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_gated_epilogue import gated_case
from test_qgemm import FP8, check, make_case, run

from qfuse.kernels import grid, schedules
from qfuse.kernels.gemm import decode as decode_gemm
from qfuse.kernels.schedules import GemmConfig


def decode(bm, bn, bk, split=1, warps=4):
    return GemmConfig(bm, bn, bk, group_m=1, split_k=split, num_warps=warps, num_stages=1,
                      decode=True)


SCHEDULES = {
    "m1": decode(1, 8, 64),
    "m2_split3": decode(2, 4, 32, split=3),  # uneven splits over 5 K steps
    "m4_split4_empty": decode(4, 16, 64, split=4),  # splits with no K step at all
}


def _schedule_cases():
    """Every schedule x dtype x K; CI runs int8 with whole words and fp8 with an odd K per
    schedule (each dtype and each K tail once per schedule), the other two are ``slow``."""
    out = []
    for name in SCHEDULES:
        for qdtype, dname in ((torch.int8, "int8"), (FP8, "fp8")):
            for K, kname in ((150, "k_odd"), (152, "k_words")):
                core = (dname, kname) in {("int8", "k_words"), ("fp8", "k_odd")}
                out.append(pytest.param(name, qdtype, K, id=f"{kname}-{dname}-{name}",
                                        marks=() if core else pytest.mark.slow))
    return out


@pytest.mark.parametrize(("name", "qdtype", "K"), _schedule_cases())
def test_decode_schedules(device, name, qdtype, K):
    cfg = SCHEDULES[name]
    # N = 21: a partial column block after one (BLOCK_N 16), two (8) or five (4) full ones, and
    # no more: the interpreter's time grows with the number of blocks.
    for M, out_dtype, x_mode in ((1, torch.int8, "static"), (5, torch.bfloat16, "channels"),
                                 (3, torch.int8, "quantized")):
        check(make_case(M, K, 21, device, qdtype=qdtype, x_mode=x_mode, act="silu",
                        out_dtype=out_dtype, residual=True), cfg)
    if qdtype == torch.int8:  # zero points: the prologue's and the epilogue's
        for x_mode in ("static", "quantized"):
            check(make_case(3, K, 21, device, x_mode=x_mode, act="gelu", out_dtype=torch.int8,
                            zp=True), cfg)
    a = make_case(2, K, 24, device, qdtype=qdtype, out_dtype=torch.int8, seed=3)
    torch.testing.assert_close(run(a, config=cfg), run(a, config=cfg), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [decode(1, 2, 64), decode(2, 4, 32)],
                         ids=["one_step", "two_steps"])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("K", [61, 60], ids=["k_odd", "k_words"])
def test_decode_whole_k(device, cfg, qdtype, K):
    """``schedules.whole_k_candidates``' shapes: K in one masked step of two rows, or two steps
    (both loads in flight) over 2-row blocks; no split-K. Small K keeps the interpreter fast."""
    for M, out_dtype, x_mode in ((1, torch.int8, "static"), (3, torch.bfloat16, "quantized")):
        check(make_case(M, K, 13, device, qdtype=qdtype, x_mode=x_mode, act="silu",
                        out_dtype=out_dtype, residual=True), cfg)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("x_mode", ["dynamic", "rows"])
def test_decode_per_token_scales(device, qdtype, x_mode):
    check(make_case(3, 64, 20, device, qdtype=qdtype, x_mode=x_mode, act="relu",
                    out_dtype=torch.float32), decode(4, 8, 32, split=2))


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_decode_gated(device, qdtype):
    # N = 2 x 35 interleaved gate/up rows: the last column block holds a partial set of pairs.
    out = torch.int8 if qdtype == torch.int8 else torch.float32
    for M in (1, 6):
        check(gated_case(M, 96, 70, device, "swiglu", qdtype=qdtype, out_dtype=out,
                         residual=True), decode(4, 8, 32, split=2))
    # whole K in one step, a two-row block holding one gate/up pair
    check(gated_case(1, 40, 14, device, "swiglu", qdtype=qdtype, out_dtype=out,
                     residual=True), decode(1, 2, 64))


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype, device=t.device)
    wide[:, 1:] = t
    return wide[:, 1:]


def test_decode_words_need_aligned_rows(device):
    """Weights or int8 x whose rows are not 4-byte aligned take the byte path, same numbers."""
    args = make_case(2, 64, 16, device, x_mode="quantized", out_dtype=torch.int8)
    w, x = _unaligned(args["weight"]), _unaligned(args["x"])
    words = decode_gemm.words
    assert not words(w) and words(args["weight"]) and words(args["x"])
    want = run(args, config=decode(2, 8, 32))
    for changed in ({"weight": w}, {"x": x}, {"weight": w, "x": x}):
        torch.testing.assert_close(run(args | changed, config=decode(2, 8, 32)), want,
                                   rtol=0, atol=0)


def test_decode_prequantized_float_x(device):
    """A separate quantize pass, then (int8) x read as words: the prologue's numbers."""
    cfg = dataclasses.replace(decode(1, 8, 64, split=2), prequantize=True)
    for zp in (False, True):
        check(make_case(1, 128, 24, device, act="silu", out_dtype=torch.int8, zp=zp), cfg)
    check(make_case(1, 128, 24, device, qdtype=FP8, act="silu", out_dtype=FP8), cfg)


def test_decode_candidates_lead_small_buckets():
    """Decode schedules come first up to DECODE_FIRST_M for int8 (where they won on the H100),
    after the MMA ones otherwise up to DECODE_MAX_M, never beyond; every split keeps a K step;
    a bucket compiles at most 16."""
    for M in (1, 8, 16, 32, 64):
        for kind in ("int8-xq", "fp8-xf"):
            cands = schedules.candidates(M, 2048, 5632, kind, 132)
            assert len(cands) <= 16
            dec = [c for c in cands if c.decode]
            if M > schedules.DECODE_MAX_M:
                assert not dec
                continue
            first = M <= schedules.DECODE_FIRST_M and kind.startswith("int8")
            assert dec and cands[0].decode == first
            for c in dec:
                assert c.block_m <= max(M, 1) and -(-5632 // c.block_k) >= c.split_k
                assert schedules.fits(c, kind)
            # whole-K ones: one or two K steps, no split, lanes within the cap, pairs whole
            whole = [c for c in dec if c.split_k == 1 and -(-5632 // c.block_k) <= 2]
            assert whole and all(c.block_n >= 2 for c in whole)
            for c in whole:
                lanes = c.block_k // 4 if kind.startswith("int8") or c.block_m > 1 else c.block_k
                assert c.block_m * c.block_n * lanes <= schedules.DECODE_LANES * 32 * c.num_warps


def _chain(layers, h, cfg, wrap=None):
    """Decode GEMMs back to back, each reading the previous one's output (and a residual two
    launches back): what a programmatic dependent launch must wait for."""
    for a in layers:
        h = run(a | {"x": h, "residual": h}, config=cfg, wrap=wrap)
    return h


def _chain_layers(n, K, qdtype):
    return [make_case(1, K, K, torch.device("cuda"), qdtype=qdtype, out_dtype=torch.bfloat16,
                      residual=True, seed=i) for i in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_decode_pdl_chain_in_graph(qdtype, monkeypatch):
    """sm_90: decode GEMMs launched as programmatic dependent launches, captured in a CUDA graph
    and replayed, give the eager chain's numbers without PDL bit for bit (a missing wait would
    read the previous GEMM's output or residual before it is written); traced calls take the
    opaque op, which launches the same way."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    from qfuse.kernels.gemm.families import FAMILIES
    from qfuse.ops.qlinear import qlinear  # noqa: F401 — registers the ops

    cfg = decode(1, 8, 256, split=4)
    layers = _chain_layers(6, 2048, qdtype)
    h0 = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(grid, "PDL_ENABLED", False)
    want = _chain(layers, h0, cfg)
    monkeypatch.setattr(grid, "PDL_ENABLED", True)
    assert grid.pdl(h0.device) and not FAMILIES["decode"].wraps(h0.device)
    h = h0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(layers, h, cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(layers, h, cfg)
    for _ in range(3):
        h.copy_(torch.randn_like(h))
        g.replay()
        torch.testing.assert_close(out, _chain(layers, h, cfg), rtol=0, atol=0)
    h.copy_(h0)
    g.replay()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    traced = torch.compile(lambda x: _chain(layers, x, cfg, torch.library.wrap_triton),
                           fullgraph=True)(h0)
    torch.testing.assert_close(traced, want, rtol=0, atol=0)
