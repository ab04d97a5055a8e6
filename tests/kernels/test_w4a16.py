"""The fused 4-bit GEMM (``kernels/gemm/w4.py``: W4A16 and W4A8, the epilogue in the same
launch) against the CPU reference (``ops.w4linear.gemm_reference`` + its epilogue), under the
Triton interpreter on CPU (and on CUDA where present).

Tolerances:
- W4A16: float32 sums in another order (per group, then scaled) than the reference's
  ``x @ dequantized W^T``: ``rtol=atol=2e-5`` of the output's magnitude (float32 products; a bf16
  x is exact in float32 and the codes ``q - zero`` exact in bf16, so bf16 x is held to the same).
- W4A8 without split-K: bit-exact (int32 group sums are exact, then the reference's float32 ops
  in its order: scale per group in group order, x scale, bias, activation, residual, cast).
  With split-K: each split chains its own groups' scaled sums and the partials are added in
  split order (a group cut by a split is scaled in two parts): ``rtol=atol=1e-6`` of the
  magnitude.

Shapes are awkward on purpose: M of 1, 3 and 17 (partial row blocks, decode and tile
schedules), N = 8 or 40 (partial column blocks, gated pairs), K of 64, 200 (not a multiple of
the K step; groups of 64 leave a last group of 8) and 256, groups of 64, 128 (longer than K = 64:
one group) and per channel, split-K, K steps shrunk to the group (group 40: a K step of 8,
served by the CUDA-core schedule)."""

from __future__ import annotations

import pytest
import torch

from qfuse import int4
from qfuse.errors import ShapeError
from qfuse.kernels.common import INTERPRETED
from qfuse.kernels.gemm.w4 import W4Config, pick_config, step_k, w4_gemm
from qfuse.nn.qlinear4 import QLinear4
from qfuse.ops.backend import use_backend
from qfuse.ops.w4linear import W4Call, _epilogue, gemm_reference, w4linear

pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")


def _call(N, K, group, symmetric, *, seed=0, act="none", bias=False, bits=16, static=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    scale, zero = int4.group_qparams(w, group, symmetric)
    q = int4.quantize_groups(w, scale, zero, group)
    b = torch.randn(N, generator=g) if bias else None
    xs = torch.tensor(static) if static is not None else None
    return W4Call(int4.pack(q), scale, zero, b, K, group, act=act, act_bits=bits, x_scale=xs,
                  x_inv_scale=torch.reciprocal(xs) if xs is not None else None)


def _to(call: W4Call, device) -> W4Call:
    move = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return W4Call(move(call.weight), move(call.scale), move(call.zero), move(call.bias),
                  call.in_features, call.group_size, call.act, call.act_bits,
                  move(call.x_scale), move(call.x_inv_scale), call.out_dtype)


def _want(x, call, residual, out_dtype):
    y = gemm_reference(x.cpu(), call)
    return _epilogue(y, call, residual.cpu() if residual is not None else None, out_dtype)


def _run(x, call, residual, out_dtype, cfg, device):
    c = _to(call, device)
    return w4_gemm(x.to(device), c.weight, c.scale, c.zero, c.bias, c.in_features,
                   c.group_size, c.act, c.act_bits, c.x_scale, c.x_inv_scale,
                   residual.to(device) if residual is not None else None, out_dtype, cfg)


def _close(got, want, exact):
    got, want = got.cpu().float(), want.float()
    mag = max(want.abs().max().item(), 1.0)
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * mag)


DEC = lambda bm, bn, bk, split=1: W4Config(bm, bn, bk, split, 4, 1, True)  # noqa: E731
TILE = lambda bm, bn, bk, split=1: W4Config(bm, bn, bk, split, 4, 2, False)  # noqa: E731

# (M, N, K, group, symmetric, act, bias, residual, x dtype, schedule or None: pick_config)
A16_CASES = {
    "m1_channel_sym": (1, 8, 64, None, True, "none", False, False, torch.float32, None),
    "m1_g64_k200_gated": (1, 40, 200, 64, False, "swiglu", True, True, torch.float32, None),
    "m3_g128_k256_split": (3, 40, 256, 128, False, "none", True, True, torch.bfloat16,
                           DEC(4, 8, 64, split=2)),
    "m3_g128_longer_than_k": (3, 8, 64, 128, True, "silu", False, False, torch.float32, None),
    "m17_g64_k200_tiles": (17, 40, 200, 64, False, "swiglu", True, True, torch.float32, None),
    "m17_channel_tiles_split": (17, 8, 256, None, False, "none", False, True, torch.bfloat16,
                                TILE(16, 16, 64, split=2)),
    "m3_g40_step8": (3, 8, 200, 40, False, "none", False, False, torch.float32,
                     TILE(16, 16, 64)),
}


@pytest.mark.parametrize("case", list(A16_CASES), ids=list(A16_CASES))
def test_w4a16(device, case):
    M, N, K, group, sym, act, bias, res, xdtype, cfg = A16_CASES[case]
    call = _call(N, K, group, sym, seed=len(case), act=act, bias=bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(xdtype)
    n_out = N // 2 if act == "swiglu" else N
    residual = torch.randn(M, n_out, generator=g) if res else None
    out_dtype = xdtype
    got = _run(x, call, residual, out_dtype, cfg, device)
    assert got.dtype == out_dtype and got.shape == (M, n_out)
    _close(got, _want(x, call, residual, out_dtype), exact=False)


# (M, N, K, group, symmetric, act, residual, static x scale or None (per token), schedule)
A8_CASES = {
    "m1_g64_dyn": (1, 40, 256, 64, False, "none", False, None, None),
    "m3_g64_k200_static_gated": (3, 40, 200, 64, True, "swiglu", True, 0.03, None),
    "m3_channel_dyn_split": (3, 8, 200, None, False, "none", True, None, DEC(4, 8, 32, 2)),
    "m3_g64_dyn_decode_exact": (3, 40, 256, 64, False, "silu", True, None, DEC(4, 16, 128)),
    "m17_g64_static_decode_prepass": (17, 8, 200, 64, True, "none", False, 0.03,
                                      DEC(16, 8, 64)),
    "m17_g128_k256_static_tiles": (17, 40, 256, 128, False, "silu", True, 0.03, None),
    "m17_g64_dyn_tiles_gated": (17, 8, 200, 64, True, "swiglu", False, None, TILE(16, 16, 64)),
}


@pytest.mark.parametrize("case", list(A8_CASES), ids=list(A8_CASES))
def test_w4a8(device, case):
    M, N, K, group, sym, act, res, static, cfg = A8_CASES[case]
    call = _call(N, K, group, sym, seed=len(case), act=act, bias=True, bits=8, static=static)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(M, K, generator=g)
    n_out = N // 2 if act == "swiglu" else N
    residual = torch.randn(M, n_out, generator=g).to(torch.bfloat16) if res else None
    got = _run(x, call, residual, torch.float32, cfg, device)
    want = _want(x, call, residual, torch.float32)
    picked = cfg or pick_config(M, N, K, group, 8, torch.device(device))
    if picked.split_k > 1:  # the splits' float32 partials are summed, not chained
        mag = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6 * mag)
    else:
        _close(got, want, exact=True)


def test_pick_config_buckets():
    cpu = torch.device("cpu")
    dec = pick_config(1, 2560, 2048, 128, 16, cpu)
    assert dec.decode and dec.block_m == 1 and step_k(dec, 2048, 128) == 128
    assert pick_config(4, 2048, 2048, 128, 8, cpu).decode  # W4A8: dp4a up to 4 rows
    assert not pick_config(16, 2048, 2048, 128, 8, cpu).decode  # then the int8 MMA
    assert not pick_config(16, 2048, 2048, 128, 16, cpu).decode  # W4A16: the MMA from 5 rows
    tile = pick_config(128, 2048, 2048, 128, 16, cpu)
    assert not tile.decode and (tile.block_m, tile.block_n, tile.block_k) == (64, 64, 64)
    assert step_k(W4Config(16, 16, 256), 200, 40) == 8  # a K step inside every group
    assert step_k(W4Config(16, 16, 256), 200, None) == 256
    # several groups a row: splits end at group boundaries (2 steps a group here)
    cfg = pick_config(1, 64, 2048, 256, 16, cpu)
    steps = 2048 // step_k(cfg, 2048, 256)
    assert cfg.split_k > 1 and (-(-steps // cfg.split_k)) % 2 == 0


def test_empty_input_and_bad_shapes(device):
    c = _to(_call(8, 64, 32, True, act="swiglu"), device)
    out = w4_gemm(torch.empty(0, 64, device=device), c.weight, c.scale, c.zero, None, 64, 32,
                  "swiglu")
    assert out.shape == (0, 4)
    with pytest.raises(ShapeError, match="features"):
        w4_gemm(torch.randn(2, 56, device=device), c.weight, c.scale, c.zero, None, 56, 32)


def test_layer_through_triton_backend(device):
    """``QLinear4`` (``w4linear``) with the triton backend equals the reference path: 3-D x,
    gated SwiGLU, bias, residual, bf16 in and out; W4A16 and W4A8 per token."""
    torch.manual_seed(4)
    w, b = torch.randn(16, 40), torch.randn(16)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    res = torch.randn(2, 3, 8).to(torch.bfloat16)
    for bits in (16, 8):
        lin = QLinear4.from_float(w, b, group_size=8, symmetric=False, act_bits=bits,
                                  activation="swiglu").to(device)
        with use_backend("reference"):
            want = lin(x.to(device), res.to(device))
        with use_backend("triton"):
            got = lin(x.to(device), res.to(device))
        assert got.shape == (2, 3, 8) and got.dtype == torch.bfloat16
        # bf16 outputs: one bf16 rounding apart at most where the float32 sums differ
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


def test_custom_op_traces_as_one_node(device):
    """``qfuse::w4linear`` under a tracer: its fake tensor, and one node in the graph."""
    call = _to(_call(8, 64, 32, False, act="relu", bias=True), device)
    x = torch.randn(3, 64).to(device)

    def f(x):
        return w4linear(x, call)

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    with use_backend("triton"):
        want = f(x)
        got = torch.compile(f, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
        assert len(ops) == 1 and ops[0] in (torch.ops.qfuse.w4linear,
                                            torch.ops.qfuse.w4linear.default)
        torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x),
                                   want, rtol=0, atol=0)
        torch.library.opcheck(torch.ops.qfuse.w4linear.default,
                              (x, call.weight, call.scale, call.zero, call.bias, None, None,
                               None, 64, 32, "relu", 16, torch.float32),
                              test_utils=("test_schema", "test_faketensor"))
