"""``qfuse.kernels.conv.stem`` (the stem gather kernel) against the reference and the old path.

int8: identical to ``ops.reference.qconv2d`` and to the patch-buffer path (``stem_path="im2col"``)
it replaced, for every schedule knob (the gathered tile's orientation, quantized in registers
or in a separate pass). fp8: within the accumulation bound ``test_conv.check`` applies. On CPU the
kernel runs in the Triton interpreter; ``test_compiles_for_sm90`` compiles it for Hopper in a
child process, as ``test_conv_sm90.py`` does for the other conv kernels.
"""

from __future__ import annotations

import json

import pytest
import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv.stem import StemConfig, stem_candidates
from tests.kernels.test_compile import compile_sm90, run_child
from tests.kernels.test_conv import check, make_case, run

FP8 = torch.float8_e4m3fn
SCHEMES = {  # (weight dtype, input zero point)
    "int8-sym": (torch.int8, False),
    "int8-asym": (torch.int8, True),
    "fp8": (FP8, False),
}
SHAPES = {
    "resnet-7x7-s2": dict(n=2, c_in=3, c_out=16, hw=(20, 20), k=7, stride=2, padding=3),
    "3x3-s2": dict(c_in=3, c_out=16, hw=(9, 8), k=3, stride=2, padding=1),
    "1-channel": dict(c_in=1, c_out=8, hw=(7, 6), k=3, stride=1, padding=1),
    "5ch-dilated-odd": dict(n=1, c_in=5, c_out=20, hw=(5, 9), k=3, padding=2, dilation=2),
}


def case(shape: str, scheme: str, channels_last: bool = True, **kw):
    qdtype, zp = SCHEMES[scheme]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_case(device, qdtype=qdtype, zp=zp, act="relu", channels_last=channels_last,
                     out_dtype=FP8 if qdtype == FP8 else torch.int8, **{**SHAPES[shape], **kw})


def small(kmajor: bool, prequantize: bool, c_out: int = 16) -> StemConfig:
    return StemConfig(32, 16 if c_out <= 16 else 32, 32, 4, 1, kmajor, prequantize)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_default_path_is_the_stem_kernel_and_matches(shape, scheme):
    args = case(shape, scheme, channels_last=shape != "3x3-s2")
    check(args)  # the default route of a stem: the gather kernel
    if args["weight"].dtype == torch.int8:
        assert torch.equal(run(args), run(args, stem_path="im2col"))


@pytest.mark.parametrize("prequantize", [False, True], ids=["registers", "separate-pass"])
@pytest.mark.parametrize("kmajor", [True, False], ids=["k-major-b", "a-operand"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_schedule_knobs_keep_the_numbers(layout, kmajor, prequantize):
    """Each knob changes how the tile is gathered, never a value: int8 with a zero point (so
    padding reads the zero point) equals the patch-buffer path bit for bit."""
    args = case("resnet-7x7-s2", "int8-asym", channels_last=layout == "nhwc", hw=(11, 10))
    out = run(args, config=small(kmajor, prequantize))
    assert torch.equal(out, run(args, stem_path="im2col"))
    check(args, config=small(kmajor, prequantize))


def test_fp8_promotion_and_quantized_input():
    check(case("3x3-s2", "fp8", x_quantized=True), config=small(True, False), fp8_promote=32)
    check(case("1-channel", "int8-asym", x_quantized=True), config=small(False, False, 8))


def test_routing():
    assert conv.conv_path(1, 3, 64, 3, 7, 7, None) == "gather"
    assert conv.conv_path(1, 16, 64, 16, 3, 3, None) == "implicit"  # enough channels per tap
    assert conv.conv_path(1, 3, 64, 3, 1, 1, None) == "implicit"  # 1x1: nothing to gather
    assert conv.conv_path(8, 8, 8, 1, 3, 3, None) == "depthwise"
    assert conv.conv_path(1, 64, 64, 64, 3, 3, "gather") == "gather"
    with pytest.raises(UnsupportedError, match="stem_path"):
        conv.conv_path(1, 3, 64, 3, 7, 7, "patches")
    with pytest.raises(UnsupportedError, match="groups=2"):
        conv.conv_path(2, 4, 8, 2, 3, 3, "gather")


def test_config_must_match_the_path():
    args = case("3x3-s2", "int8-sym")
    with pytest.raises(UnsupportedError, match="StemConfig"):
        run(args, config=conv.ConvConfig(32, 32, 32, 4, 1))
    assert torch.equal(run(args, config=conv.ConvConfig(32, 32, 32, 4, 1),
                                    stem_path="flat"), run(args))
    wide = make_case("cpu", c_in=16, c_out=16)
    with pytest.raises(UnsupportedError, match="'implicit' path"):
        run(wide, config=small(True, False))
    for bad in (dict(block_m=48), dict(block_k=8), dict(fp8_promote=64)):
        with pytest.raises(UnsupportedError, match="StemConfig"):
            StemConfig(**{**vars(small(True, False)), **bad})


def test_candidates():
    cands = stem_candidates(64)
    assert len(set(cands)) == len(cands) >= 3
    assert all(c.block_n == 64 and c.block_k == 32 for c in cands)  # K = 147 pads to 160
    assert stem_candidates(3)[0].block_n == 16


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("batch", [1, 32])
def test_gpu_resnet_stem_every_candidate(batch, scheme):
    """The ResNet stem at full size: every candidate schedule on channels-last input (as the
    converted models run) and the default on NCHW input equal the patch-buffer path (int8) or
    agree within fp8's bound; batch 1 also against the CPU reference."""
    for channels_last in (False, True):
        args = case("resnet-7x7-s2", scheme, channels_last, n=batch, c_out=64, hw=(224, 224))
        old = run(args, stem_path="im2col")
        for cfg in stem_candidates(64) if channels_last else stem_candidates(64)[:1]:
            out = run(args, config=cfg)
            if args["weight"].dtype == torch.int8:
                assert torch.equal(out, old), cfg
            elif batch == 1:
                check(args, config=cfg)
        if batch == 1:
            check(args)


# (input layout, weight, x) compiled with the first candidate's tiles: in-register quantization
# of a bf16 input and a prequantized byte gather; channels-last specializes the channel stride
SM90 = [(False, "*i8", "*bf16"), (False, "*fp8e4nv", "*bf16"), (True, "*i8", "*i8")]


def child_main() -> None:
    from qfuse.kernels.common import ACTIVATION_CODES
    from qfuse.kernels.conv import stem

    results = {}
    for channels_last, w, x in SM90:
        cfg = stem.stem_candidates(64)[0]
        ptrs = {n: "*fp32" for n in ("scale_ptr", "bias_ptr", "x_inv_scale_ptr",
                                     "res_scale_ptr", "out_inv_scale_ptr")}
        ptrs.update(x_ptr=x, w_ptr=w, x_zp_ptr="*i32", wsum_ptr="*i32", res_ptr="*bf16",
                    res_zp_ptr="*i32", out_zp_ptr="*i32", out_ptr=w)
        consts = dict(C=3, SH=2, SW=2, PH=3, PW=3, DH=1, DW=1, KH=7, KW=7, FP8="fp8" in w,
                      X_QUANTIZED=x == w, HAS_X_ZP=False, HAS_BIAS=True,
                      ACT=ACTIVATION_CODES["relu"], HAS_RESIDUAL=False, RES_Q=False,
                      HAS_RES_ZP=False, POST_ACT=0, OUT_Q=2 if "fp8" in w else 1,
                      HAS_OUT_ZP=False, OUT_MANT=0, OUT_EMIN=0, EXACT=False, LARGE=False,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      KMAJOR=cfg.kmajor, FP8_PROMOTE=0)
        consts["sxc" if channels_last else "sxw"] = 1  # as Triton specializes a unit stride
        kernel = compile_sm90(stem._stem_kernel, ptrs, consts, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)
        ptx = kernel.asm["ptx"]
        results[f"{w}-{x}-{'nhwc' if channels_last else 'nchw'}"] = {
            "shared": kernel.metadata.shared, "wgmma": "wgmma" in ptx,
            "mul_rn": "mul.rn.f32" in ptx, "spill_stores": _spill_stores(kernel.asm["cubin"])}
    print(json.dumps(results))


def _spill_stores(cubin: bytes) -> int:
    """Local-memory stores (register spills) in the SASS, by the cuobjdump Triton ships."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return sass.count(" STL")


def test_compiles_for_sm90():
    """The first candidate compiles for Hopper, fits its shared memory, uses wgmma, keeps the
    epilogue's explicitly rounded products (int8 bit-exactness) and barely spills (1-3 stores
    at 255 registers, in-register int8 quantization): with the gather's lanes on K instead of
    pixels (``stem.PIXEL_FAST_KMAJOR`` wrong for the installed Triton) it spills ~120."""
    for name, info in run_child(__file__).items():
        assert info["shared"] <= 232448, name
        assert info["wgmma"] and info["mul_rn"], name
        assert info["spill_stores"] <= 8, name


if __name__ == "__main__":
    child_main()
