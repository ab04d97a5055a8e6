"""``kernels.conv_tma`` (1x1 stride-1 convs as a descriptor GEMM, split-K) against
``ops.reference.qconv2d``, and ``implicit.qconv2d``'s routing to it.

Under the interpreter (CPU, CI) descriptor loads zero-fill past the edges as the copy engine does;
tiny shapes with ragged M, C_out and K, split-K 1 and 2-3 (so the workspace reduce runs).
int8: bit-exact; fp8: ``test_conv.check``'s accumulation bound. ``-m gpu`` on the device runs
resnet50's 1x1 shapes, eager and through ``torch.compile`` (the opaque ``qfuse::tma_conv1x1``).
"""

from __future__ import annotations

import pytest
import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv import tma as conv_tma
from qfuse.kernels.conv.tma import Conv1x1Config
from tests.kernels.test_conv import FP8, check, make_case, run, split

ONE = dict(k=1, padding=0)
# 16x32x32 tiles over M = 35 (ragged), C_out = 40 (ragged), K = 96 (3 K steps) or 48 (ragged)
SMALL = dict(n=1, c_in=96, c_out=40, hw=(5, 7), **ONE)
CASES = {
    "plain": dict(bias=False),
    "bias-relu": dict(act="relu"),
    "residual-quantized-zp-post-relu": dict(residual="quantized", zp=True, post_act="relu",
                                            act="relu"),
    "residual-float-out": dict(residual=True, post_act="relu", out_dtype=torch.float32,
                               x_quantized=True),
    "x-zp-quantized-in": dict(zp=True, x_quantized=True, act="relu6", c_in=48),
    "bf16-out": dict(out_dtype=torch.bfloat16, act="silu"),
}


def cfg(split_k: int, epi_split: int = 1) -> Conv1x1Config:
    return Conv1x1Config(16, 32, 32, 4, 1, split_k=split_k, epi_split=epi_split)


@pytest.fixture
def calls(monkeypatch):
    """Counts launches of the TMA conv (proof a call took that path)."""
    seen = []
    real = conv_tma.conv1x1

    def spy(*args, **kw):
        seen.append(kw.get("config", args[4] if len(args) > 4 else None))
        return real(*args, **kw)

    monkeypatch.setattr(conv_tma, "conv1x1", spy)
    return seen


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("qdtype", "split_k", "epi_split"),
                         [(torch.int8, 1, 1), (torch.int8, 2, 2), (torch.int8, 3, 1),
                          (FP8, 1, 2), (FP8, 2, 1)],
                         ids=["int8-split1", "int8-split2-epi2", "int8-split3", "fp8-split1-epi2",
                              "fp8-split2"])
def test_epilogues_and_split_k(calls, qdtype, split_k, epi_split, name):
    spec = {**SMALL, **CASES[name]}
    if qdtype == FP8:
        spec.pop("zp", None)  # fp8 is symmetric
    out = spec.get("out_dtype", qdtype)
    check(make_case("cpu", qdtype=qdtype, **{**spec, "out_dtype": out}),
          config=cfg(split_k, epi_split))
    assert calls == [cfg(split_k, epi_split)]


def test_auto_route_takes_the_tma_gemm(calls):
    """C_in % 16 == 0, channels-last, 1x1 stride 1: the TMA GEMM with its own schedule, for a
    quantized input or a float one of >= FLOAT_X_MIN_M rows (quantized in its own pass)."""
    check(make_case("cpu", **{**SMALL, "c_in": 32}, act="relu", x_quantized=True))
    assert calls == [None]  # no config passed: conv1x1 picks (INTERPRETER_CONFIG here)
    check(make_case("cpu", **{**SMALL, "c_in": 32, "hw": (8, 16)}, act="relu"))
    assert len(calls) == 2
    check(make_case("cpu", **{**SMALL, "c_in": 32}, act="relu"))  # float, 35 rows
    assert len(calls) == 2


@pytest.mark.parametrize("spec", [
    dict(c_in=8),                                 # rows of 8 bytes: no descriptor
    dict(c_in=32, channels_last=False),           # NCHW: rows are not contiguous
    dict(c_in=32, stride=2),                      # not a GEMM over the input's rows
    dict(c_in=32, k=3, padding=1),
], ids=["c_in-8", "nchw", "stride-2", "3x3"])
def test_other_convs_stay_on_the_implicit_gemm(calls, spec):
    args = make_case("cpu", n=1, c_out=16, hw=(3, 4), **{**ONE, **spec})
    check(args)
    assert calls == []
    with pytest.raises(UnsupportedError, match="conv1x1_path='tma'"):
        run(args, conv1x1_path="tma")


def test_forced_paths_agree(calls):
    args = make_case("cpu", **{**SMALL, "c_in": 32}, residual="quantized", zp=True)
    mma = run(args, conv1x1_path="mma")
    assert calls == []
    tma = run(args, conv1x1_path="tma", config=cfg(2))
    assert calls == [cfg(2)]
    assert torch.equal(mma, tma)
    # a ConvConfig pins the implicit GEMM; a Conv1x1Config fits nothing else
    run(args, config=conv.ConvConfig(32, 32, 32, 4, 1))
    assert len(calls) == 1
    with pytest.raises(UnsupportedError, match="Conv1x1Config"):
        run(args, config=cfg(1), conv1x1_path="mma")
    with pytest.raises(UnsupportedError, match="conv1x1_path='gemm'"):
        run(args, conv1x1_path="gemm")


def test_traced_route_is_the_opaque_op(calls):
    """With a launcher (``wrap_triton`` when ``qfuse::qconv2d`` is traced) the conv goes through
    ``qfuse::tma_conv1x1`` with the schedule as integers; the op's fake agrees with its body."""
    args = make_case("cpu", **{**SMALL, "c_in": 32}, x_quantized=True, residual="quantized",
                     zp=True, act="relu", post_act="relu")
    assert torch.equal(run(args, launcher=lambda k: k),
                       run(args, conv1x1_path="mma"))
    assert calls == [conv_tma.INTERPRETER_CONFIG]  # rebuilt from the op's integer list
    wsum = args["weight"].to(torch.int32).sum(dim=(1, 2, 3), dtype=torch.int32)
    x, call, residual = split(args)
    op_args = (*call.op_args(x, residual), wsum, [32, 32, 32, 4, 1, 2, 8, 0, 2])
    torch.library.opcheck(torch.ops.qfuse.tma_conv1x1, op_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_env_default_keeps_1x1_convs_on_the_implicit_gemm(calls, monkeypatch):
    """``QFUSE_CONV1X1_PATH=mma`` (read at import into ``DEFAULT_PATH``): no TMA conv."""
    monkeypatch.setattr(conv_tma, "DEFAULT_PATH", "mma")
    check(make_case("cpu", **{**SMALL, "c_in": 32}, act="relu", x_quantized=True))
    assert calls == []


def test_conv_path_rule():
    assert conv.conv_path(1, 64, 256, 64, 1, 1, None, gemm_fits=True) == "gemm1x1"
    assert conv.conv_path(1, 64, 256, 64, 1, 1, None, True, "mma") == "implicit"
    assert conv.conv_path(1, 64, 256, 64, 1, 1, None, False) == "implicit"
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        conv.conv_path(1, 8, 256, 8, 1, 1, None, False, "tma")


def test_misaligned_input_is_copied(calls):
    """A descriptor needs a 16-byte aligned base: a view one byte in is read from a copy."""
    args = make_case("cpu", **{**SMALL, "c_in": 32}, x_quantized=True, act="relu")
    x = args["x"]
    big = torch.empty(x.numel() + 1, dtype=x.dtype)
    big[1:].copy_(x.permute(0, 2, 3, 1).reshape(-1))
    n, c, h, w = x.shape
    args["x"] = big[1:].view(n, h, w, c).permute(0, 3, 1, 2)
    assert args["x"].data_ptr() % 16 and conv_tma.fits(args["x"], args["weight"], [1, 1],
                                                       [0, 0], [1, 1], 1)
    check(args, config=cfg(1))
    assert calls == [cfg(1)]


def test_schedule_rule_splits_long_k_on_small_grids():
    # resnet50 at batch 32: 7x7 2048 -> 512 has 52 128x128 tiles for 132 SMs
    for M, N, K in ((1568, 512, 2048), (6272, 256, 1024), (1568, 2048, 512)):
        for c in conv_tma.conv1x1_candidates(M, N, K, 132):
            tiles = -(-M // c.block_m) * -(-N // c.block_n)
            k_steps = -(-K // c.block_k)
            assert c.split_k == 1 or (tiles * c.split_k // 2 < 132
                                      and k_steps // c.split_k >= 4)
    assert all(c.split_k > 1 for c in conv_tma.conv1x1_candidates(1568, 512, 2048, 132))
    assert all(c.split_k == 1 for c in conv_tma.conv1x1_candidates(100352, 256, 64, 132))
    assert all(c.block_k == 64 for c in conv_tma.conv1x1_candidates(100352, 256, 64, 132))
    for bad in (dict(split_k=0), dict(block_k=8), dict(fp8_promote=48), dict(epi_split=4)):
        with pytest.raises(UnsupportedError, match="Conv1x1Config"):
            Conv1x1Config(**{**vars(Conv1x1Config(64, 64, 128, 4, 3)), **bad})


# resnet50 (torchvision, batch 32) 1x1 stride-1 shapes: (n, c_in, c_out, hw, extra)
RESNET = [
    dict(n=32, c_in=2048, c_out=512, hw=(7, 7)),                       # M=1568, split-K
    dict(n=32, c_in=1024, c_out=256, hw=(14, 14)),                     # M=6272
    dict(n=32, c_in=128, c_out=512, hw=(28, 28), residual="quantized",
         post_act="relu"),                                             # M=25088
]


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", RESNET, ids=["7x7-2048-512", "14x14-1024-256",
                                               "28x28-128-512-res"])
def test_gpu_resnet_shapes(calls, shape, qdtype):
    shape = {**shape, **ONE}
    out = FP8 if qdtype == FP8 else torch.int8
    check(make_case("cuda", qdtype=qdtype, out_dtype=out, act="relu", **shape))
    picked = calls[-1] or conv_tma.pick_conv1x1_config(
        shape["n"] * shape["hw"][0] * shape["hw"][1], shape["c_out"], shape["c_in"],
        conv_tma.sm_count(torch.device("cuda")), shape.get("residual") is not None)
    if shape["c_in"] == 2048:
        assert picked.split_k > 1
    for c in conv_tma.conv1x1_candidates(shape["n"] * shape["hw"][0] * shape["hw"][1],
                                         shape["c_out"], shape["c_in"]):
        check(make_case("cuda", qdtype=qdtype, out_dtype=out, act="relu", **shape), config=c)
    plain = {k: v for k, v in shape.items() if k not in ("residual", "post_act")}
    check(make_case("cuda", qdtype=qdtype, out_dtype=torch.float32, residual=True,
                    post_act="relu", x_quantized=True, **plain))


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_gpu_compiled_route_matches_eager(calls, qdtype):
    """Under torch.compile the 1x1 conv runs through the opaque ``qfuse::tma_conv1x1``."""
    from qfuse.ops import qconv2d as op  # noqa: F401 — registers qfuse::qconv2d

    a = make_case("cuda", n=32, c_in=2048, c_out=512, hw=(7, 7), qdtype=qdtype, act="relu",
                  out_dtype=qdtype, residual="quantized", **ONE)
    x, call, residual = split(a)
    pos = call.op_args(x, residual)
    eager = run(a)
    n_eager = len(calls)
    compiled = torch.compile(lambda *p: torch.ops.qfuse.qconv2d(*p), fullgraph=True)
    out = compiled(*pos)
    assert len(calls) > n_eager  # the opaque op's body launched the TMA conv
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.float(), eager.float())  # same kernel, schedule and input
