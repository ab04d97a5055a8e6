"""Compile the kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter accepts code the compiler rejects: the spine's first GPU run failed because a
@jit function read a plain global (``ROUND_MAGIC``), which the interpreter allowed. Compiling to
a cubin here (Triton's own front end, LLVM and the ptxas its wheel ships) catches that class of
bug in CI, and the shared-memory figure guards the schedules against launch failures.

The tests run in a child process with ``TRITON_INTERPRET=0``: under the interpreter (this test
session's setting) ``@triton.jit`` functions are interpreter objects that cannot be compiled.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

CHILD = os.environ.get("QFUSE_COMPILE_CHILD") == "1"
if CHILD:
    import triton
    from triton.backends.compiler import GPUTarget

    from qfuse.kernels import quantize
    from qfuse.kernels.common import ACTIVATION_CODES
    from qfuse.kernels.gemm.kernel import _qlinear_kernel

    TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, pointer_types: dict[str, str], constexprs: dict, **options):
    """``triton.compile`` for sm_90; non-constexpr arguments not in ``pointer_types`` are i32."""
    names = inspect.signature(fn.fn).parameters
    signature = {n: pointer_types.get(n, "i32") for n in names}
    signature.update({n: "constexpr" for n in constexprs})
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=TARGET, options={"enable_fp_fusion": False, **options})


def qgemm_pointers(qdtype: str, x: str, out: str, acc: str) -> dict[str, str]:
    ptrs = {n: "*fp32" for n in ("scale_ptr", "x_scale_ptr", "bias_ptr", "x_inv_scale_ptr",
                                 "out_inv_scale_ptr")}
    ptrs.update(x_ptr=x, w_ptr=qdtype, x_zp_ptr="*i32", wsum_ptr="*i32", res_ptr="*bf16",
                out_zp_ptr="*i32", out_ptr=out, ws_ptr=acc, lock_ptr="*i32")
    return ptrs


VARIANTS = [
    # (weight, x, out, X_QUANTIZED, X_ROW_SCALE, OUT_Q, SPLIT_K, ACT, blocks, warps, stages,
    #  persistent)
    ("*i8", "*bf16", "*bf16", False, False, 0, 1, "gelu", (128, 256, 128), 8, 3, False),
    ("*i8", "*i8", "*i8", True, False, 1, 4, "relu", (16, 64, 256), 4, 4, False),
    ("*fp8e4nv", "*bf16", "*fp8e4nv", False, False, 2, 1, "silu", (128, 128, 128), 8, 4, False),
    ("*fp8e4nv", "*fp8e4nv", "*fp16", True, True, 0, 2, "gelu_tanh", (64, 128, 128), 4, 4, False),
    # gate/up with the SwiGLU epilogue handing int8/fp8 to down: decode (16 rows, 32-column
    # tiles, split-K) and prefill (a quantized x)
    ("*i8", "*bf16", "*i8", False, False, 1, 1, "swiglu", (16, 64, 256), 4, 4, False),
    ("*fp8e4nv", "*bf16", "*fp8e4nv", False, False, 2, 2, "swiglu", (16, 32, 512), 4, 3, False),
    ("*i8", "*i8", "*i8", True, False, 1, 1, "geglu", (64, 128, 128), 4, 4, False),
    # the persistent kernel (flattened tile loop) with int8 and fp8 hand-offs
    ("*i8", "*i8", "*bf16", True, False, 0, 1, "none", (128, 128, 128), 8, 4, True),
    ("*fp8e4nv", "*fp8e4nv", "*fp8e4nv", True, False, 2, 1, "gelu", (128, 128, 64), 4, 4, True),
]


def compile_qlinear(variant) -> dict:
    w, x, out, xq, rows, out_q, split, act, (bm, bn, bk), warps, stages, persistent = variant
    acc = "*fp32" if "fp8" in w else "*i32"
    constexprs = dict(
        FP8="fp8" in w, X_QUANTIZED=xq, X_INV_VEC=not xq and "fp8" in w, X_ROW_SCALE=rows,
        HAS_X_ZP=not xq and "i8" in w,
        ZP_CORR=not xq and "i8" in w,
        HAS_BIAS=True, ACT=ACTIVATION_CODES[act], HAS_RESIDUAL=True, OUT_Q=out_q,
        HAS_OUT_ZP=out_q == 1, OUT_MANT=0, OUT_EMIN=0, EXACT=False,
        FAST_ACT=act in ("silu", "swiglu", "geglu"),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
        EPI_SPLIT=2 if act == "gelu" else 1, PERSISTENT=persistent, TMA=False, DECODE=False,
        WORDS=False, EVEN_K=False, X_WORDS=False, PDL=False,
    )
    kernel = compile_sm90(_qlinear_kernel, qgemm_pointers(w, x, out, acc), constexprs,
                          num_warps=warps, num_stages=stages)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "wgmma": "wgmma" in ptx, "bm": bm,
            "mul_rn": "mul.rn.f32" in ptx}


def compile_quantize(fp8, dynamic) -> None:
    ptrs = dict(x_ptr="*bf16", inv_scale_ptr="*fp32", zp_ptr="*i32", scale_ptr="*fp32",
                q_ptr="*fp8e4nv" if fp8 else "*i8")
    constexprs = dict(FP8=fp8, DYNAMIC=dynamic, INV_VEC=not dynamic and fp8,
                      HAS_ZP=not fp8 and not dynamic, EXACT=False, BLOCK_M=4, BLOCK_K=1024)
    compile_sm90(quantize._quantize_kernel, ptrs, constexprs, num_warps=4)


def compile_layernorm(fp8) -> None:
    from qfuse.kernels import layernorm

    ptrs = dict(x_ptr="*bf16", w_ptr="*fp32", b_ptr="*fp32", inv_scale_ptr="*fp32",
                zp_ptr="*i32", y_ptr="*bf16", q_ptr="*fp8e4nv" if fp8 else "*i8")
    # RMS mode on the fp8 variant: transformers' RMSNorm (no bias, bf16 rounding before the weight)
    constexprs = dict(EPS=1e-12, HAS_W=True, HAS_B=not fp8, HAS_ZP=not fp8, FP8=fp8, WRITE_Y=True,
                      Y_MANT=7, Y_EMIN=-126, EXACT=False, BLOCK_M=4, BLOCK_D=1024, RMS=fp8,
                      H_MANT=7 if fp8 else 0, H_EMIN=-126 if fp8 else 0)
    compile_sm90(layernorm._ln_quant_kernel, ptrs, constexprs, num_warps=4)


def child_main() -> None:
    results = [compile_qlinear(v) for v in VARIANTS]
    for fp8 in (False, True):
        compile_layernorm(fp8)
        for dynamic in (False, True):
            compile_quantize(fp8, dynamic)
    print(json.dumps(results))


def run_child(script: str):
    """Run ``script`` (a test module's ``__main__``) as the compiling child; its last stdout line,
    parsed as JSON."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", QFUSE_COMPILE_CHILD="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    return run_child(__file__)


def test_epilogue_products_are_explicitly_rounded(compiled):
    # common.mul_rn: exact even where torch.compile launches without enable_fp_fusion=False
    assert all(info["mul_rn"] for info in compiled)


@pytest.mark.parametrize("i", range(len(VARIANTS)))
def test_schedule_fits_and_uses_wgmma(compiled, i):
    info = compiled[i]
    assert info["shared"] <= 232448, "more shared memory than an H100/H200 block may have"
    assert info["wgmma"] or info["bm"] < 64, "an int8/fp8 dot of 64+ rows must use wgmma"


if __name__ == "__main__":
    child_main()
