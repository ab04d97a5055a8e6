"""The decode schedule compiled for Hopper (sm_90) without a GPU, as a real launch specializes it
(16-byte aligned pointers, sizes and row strides multiples of 16, unit strides constant): the
weights must stream in 16-byte vector loads, int8 through ``dp4a``, with no register spills.

These are the properties the kernel's speed rests on (``kernels/gemm/decode.py``), and the ones
the interpreter cannot see: before the row starts were formed in bytes, the int8 words were read
by scalar 4-byte loads. Compiled in a child process, as in test_compile.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile

import pytest
from test_compile import run_child

CHILD = os.environ.get("QFUSE_COMPILE_CHILD") == "1"

VARIANTS = [
    # (weight, x, out, X_QUANTIZED, ACT, OUT_Q, (BLOCK_M, BLOCK_N, BLOCK_K), SPLIT_K, WORDS)
    ("*i8", "*bf16", "*bf16", False, "none", 0, (1, 8, 512), 4, True),  # q/k/v, o_proj
    ("*i8", "*bf16", "*i8", False, "swiglu", 1, (1, 8, 512), 1, True),  # gate+up
    ("*i8", "*i8", "*bf16", True, "none", 0, (8, 8, 256), 4, True),  # down, 8 tokens
    ("*fp8e4nv", "*bf16", "*fp8e4nv", False, "swiglu", 2, (1, 8, 256), 1, False),
    ("*fp8e4nv", "*fp8e4nv", "*bf16", True, "none", 0, (8, 8, 256), 4, False),
]


def compile_decode(variant) -> dict:
    import triton
    from test_compile import TARGET, qgemm_pointers

    from qfuse.kernels.common import ACTIVATION_CODES
    from qfuse.kernels.gemm.kernel import _qlinear_kernel as fn

    w, x, out, xq, act, out_q, (bm, bn, bk), split, words = variant
    names = list(inspect.signature(fn.fn).parameters)
    constexprs = dict(
        FP8="fp8" in w, X_QUANTIZED=xq, X_INV_VEC=False, X_ROW_SCALE=False, HAS_X_ZP=False,
        ZP_CORR=False, HAS_BIAS=True, ACT=ACTIVATION_CODES[act], HAS_RESIDUAL=True, OUT_Q=out_q,
        HAS_OUT_ZP=False, OUT_MANT=0, OUT_EMIN=0, EXACT=False, FAST_ACT=False, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split, EPI_SPLIT=1, PERSISTENT=False,
        TMA=False, DECODE=True, WORDS=words, EVEN_K=True,
        X_WORDS=words and xq, PDL=True,  # as sm_90 launches it (``grid.pdl``)
        stride_xk=1, stride_wk=1, stride_rn=1, stride_on=1,  # Triton specializes 1 as constant
    )
    ptrs = qgemm_pointers(w, x, out, "*fp32" if "fp8" in w else "*i32")
    signature = {n: ptrs.get(n, "i32") for n in names}
    signature.update({n: "constexpr" for n in constexprs})
    aligned = [n for n in names if n.endswith("_ptr")
               or n in ("N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    kernel = triton.compile(src, target=TARGET,
                            options={"enable_fp_fusion": False, "num_warps": 4, "num_stages": 1,
                                     "launch_pdl": True})
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                          capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    # Where the dependent-launch wait sits: after the first weight load, before any x load.
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    first_w = re.search(r"ld\.global(?:\.\w+)*\.v4\.b32", body)  # W's 16-byte loads
    return dict(v4=len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
                wait=wait, first_load=first_w.start() if first_w else -1,
                launch_dependents=body.count("griddepcontrol.launch_dependents"),
                launch_pdl=bool(kernel.metadata.launch_pdl),
                b8=len(re.findall(r"ld\.global(?:\.\w+)*\.b8", ptx)),
                dp4a=ptx.count("dp4a.s32.s32"), regs=int(regs[1]) if regs else -1,
                spills=int(spills[1]) if spills else -1)


@pytest.fixture(scope="module")
def compiled():
    return run_child(__file__)


@pytest.mark.parametrize("i", range(len(VARIANTS)))
def test_weights_stream_in_16_byte_loads(compiled, i):
    info, words = compiled[i], VARIANTS[i][-1]
    assert info["v4"] >= 2, info  # the step multiplied and the one loaded ahead
    assert (info["dp4a"] > 0) == words, info
    assert info["spills"] == 0 and 0 < info["regs"] <= 168, info
    if words and VARIANTS[i][3]:  # int8 x handed over: read as words too, no byte loads
        assert info["b8"] == 0, info
    # programmatic dependent launch: one wait, after the first weight load was issued
    assert info["launch_pdl"] and info["launch_dependents"] == 1, info
    assert 0 <= info["first_load"] < info["wait"], info


if __name__ == "__main__":
    print(json.dumps([compile_decode(v) for v in VARIANTS]))
