"""``kernels.gemm.tma`` (descriptor loads) against ``ops.reference``: every epilogue, ragged
edges in M, N and K, one-tile and persistent grids, both dtypes.

Under the interpreter (CPU, CI) descriptor loads zero-fill past the edges as the copy engine
does; on a GPU (``-m gpu`` on the device) the same cases run the real TMA path, plus the traced
route (``qfuse::qlinear_launch`` inside a compiled graph). int8: bit-exact, as test_qgemm.
"""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.schedules import GemmConfig, tma_candidates
from tests.kernels.test_qgemm import FP8, check, make_case, run

# Small tiles (the interpreter's cost grows with the tile), persistent and one-tile grids.
TMA = [
    GemmConfig(32, 32, 32, group_m=2, num_stages=2, prequantize=True, tma=True),
    GemmConfig(16, 64, 32, num_stages=2, prequantize=True, tma=True, persistent=True),
    GemmConfig(32, 64, 64, num_stages=2, prequantize=True, tma=True, epi_split=2,
               persistent=True),
]
IDS = ["tile", "persistent", "persistent_epi2"]


@pytest.mark.parametrize("cfg", TMA, ids=IDS)
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_tma_epilogues(device, cfg, qdtype):
    # M over several row blocks, N ragged, K a few blocks with a ragged tail (multiple of 16).
    for out_dtype, x_mode, act in ((torch.int8, "static", "gelu"),
                                   (torch.bfloat16, "quantized", "silu"),
                                   (torch.float32, "rows", "relu")):
        check(make_case(37, 144, 70, device, qdtype=qdtype, x_mode=x_mode, act=act,
                        out_dtype=out_dtype, residual=True), cfg)


@pytest.mark.parametrize("cfg", TMA[:2], ids=IDS[:2])
def test_tma_zero_points_and_channels(device, cfg):
    for x_mode in ("static", "quantized", "channels"):
        check(make_case(37, 96, 70, device, x_mode=x_mode, act="gelu", out_dtype=torch.int8,
                        zp=True, bias=False), cfg)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_tma_gated(device, qdtype):
    """SwiGLU over interleaved gate/up rows: N = 2 x 40 weight rows -> 40 outputs."""
    args = make_case(21, 64, 80, device, qdtype=qdtype, x_mode="quantized", act="swiglu",
                     out_dtype=torch.bfloat16)
    check(args, TMA[1])


def test_tma_misaligned_x_is_copied(device):
    """A descriptor needs a 16-byte aligned base: a view one byte in is read from a copy."""
    args = make_case(9, 48, 24, device, x_mode="quantized", act="relu", out_dtype=torch.int8)
    big = torch.empty(9 * 48 + 1, dtype=torch.int8, device=device)
    big[1:].copy_(args["x"].reshape(-1))
    args["x"] = big[1:].view(9, 48)
    check(args, TMA[0])


def test_tma_candidates_only_where_descriptors_fit():
    assert tma_candidates(4096, 768, 768, False)
    assert all(c.tma and c.prequantize for c in tma_candidates(4096, 768, 768, True))
    assert tma_candidates(4096, 768, 760, False) == []  # row pitch not a multiple of 16
    assert tma_candidates(16, 768, 768, False) == []  # weight streaming: no TMA


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_tma_traced_route_matches_eager(qdtype):
    """Under torch.compile a TMA schedule runs through the opaque ``qfuse::qlinear_launch``."""
    from qfuse.ops.qlinear import qlinear  # noqa: F401 — registers qfuse::qlinear

    args = make_case(256, 768, 768, torch.device("cuda"), qdtype=qdtype, x_mode="quantized",
                     act="gelu", out_dtype=qdtype, residual=False)
    cfg = GemmConfig(128, 128, 64, num_warps=4, num_stages=4, tma=True)
    eager = run(args, config=cfg)

    def f(a):
        return run(a, config=cfg, wrap=torch.library.wrap_triton)

    traced = torch.compile(f, fullgraph=True)(args)
    assert torch.equal(traced.view(torch.uint8), eager.view(torch.uint8))
