"""Registers, spills and shared memory of fused-GEMM variants compiled for sm_90 on any machine
(no GPU: ``triton.compile`` for a ``GPUTarget``, then ``ptxas -v`` on the PTX).

    python -m bench.diag.sm90_resources

The rows are the encoder FFN-up layer as the converted models run it (GELU, int8/fp8 out), with
the symmetric and the asymmetric (zero-point) int8 epilogue, and the FFN-down / attention layers
without an activation: a schedule that spills pays local-memory traffic in every tile's epilogue.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from qfuse.kernels.common import ACTIVATION_CODES
from qfuse.kernels.gemm.kernel import _qlinear_kernel

PTXAS = str(__import__("pathlib").Path(triton.__file__).parent / "backends/nvidia/bin/ptxas")
TARGET = GPUTarget("cuda", 90, 32)
# Integer arguments a model's launch passes as multiples of 16 (dims and row strides).
ALIGNED_INTS = {"N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om"}


def compile_variant(tma: bool, fp8: bool, act: str, out_q: int, zp: bool, bm: int, bn: int,
                    bk: int, warps: int, stages: int, epi: int) -> dict:
    names = list(inspect.signature(_qlinear_kernel.fn).parameters)
    q = "fp8e4nv" if fp8 else "i8"
    sig = {n: "i32" for n in names}
    for n in ("scale_ptr", "x_scale_ptr", "bias_ptr", "x_inv_scale_ptr", "out_inv_scale_ptr"):
        sig[n] = "*fp32"
    # a TMA schedule's x and W are tensor descriptors (``gemm.tma.tma_args``)
    x_type, w_type = ((f"tensordesc<{q}[{bm}, {bk}]>", f"tensordesc<{q}[{bn}, {bk}]>") if tma
                      else (f"*{q}", f"*{q}"))
    sig.update(x_ptr=x_type, w_ptr=w_type, x_zp_ptr="*i32", wsum_ptr="*i32", res_ptr="*bf16",
               out_zp_ptr="*i32", out_ptr=f"*{q}" if out_q else "*bf16",
               ws_ptr="*fp32" if fp8 else "*i32", lock_ptr="*i32")
    cx = dict(FP8=fp8, X_QUANTIZED=True, X_INV_VEC=False, X_ROW_SCALE=False, HAS_X_ZP=zp,
              ZP_CORR=zp, HAS_BIAS=True, ACT=ACTIVATION_CODES[act], HAS_RESIDUAL=act == "none",
              OUT_Q=out_q, HAS_OUT_ZP=zp and out_q == 1, OUT_MANT=0, OUT_EMIN=0, EXACT=False,
              FAST_ACT=act != "none", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=1,
              EPI_SPLIT=epi,
              # the family's flags as ``families`` binds them for a launch on sm_90 (``mma`` or
              # ``tma``; a TMA launch is a programmatic dependent one there, ``grid.pdl``)
              PERSISTENT=False, TMA=tma, DECODE=False, WORDS=False, EVEN_K=False,
              X_WORDS=False, PDL=tma)
    # Unit strides are constexpr 1 and pointers / multiples of 16 carry tt.divisibility = 16,
    # as the JIT specializes a real launch (without them loads are not vectorized and the
    # K loop is not pipelined: the counts would describe another kernel).
    cx.update(stride_xk=1, stride_wk=1, stride_rn=1, stride_on=1)
    cx = {k: v for k, v in cx.items() if k in names}
    sig = {k: ("constexpr" if k in cx else v) for k, v in sig.items() if k in names}
    aligned = [i for i, n in enumerate(names) if n not in cx and n != "M"
               and (sig[n].startswith("*") or n in ALIGNED_INTS)]
    src = triton.compiler.ASTSource(fn=_qlinear_kernel, signature=sig, constexprs=cx,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=TARGET, options={"enable_fp_fusion": False,
                                                    "num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        res = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", res)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_stores=int(spill.group(1)) if spill else None,
                spill_loads=int(spill.group(2)) if spill else None, shared=k.metadata.shared)


# (layer, tma, fp8, act, out_q, zp, bm, bn, bk, warps, stages, epi)
ROWS = [
    ("ffn_up", False, False, "gelu", 1, True, 128, 128, 64, 4, 3, 1),
    ("ffn_up", False, False, "gelu", 1, True, 128, 128, 64, 4, 4, 2),
    ("ffn_up", False, False, "gelu", 1, False, 128, 128, 64, 4, 3, 1),
    ("ffn_up", True, False, "gelu", 1, True, 128, 128, 64, 4, 4, 1),
    ("ffn_up", True, False, "gelu", 1, True, 128, 128, 64, 4, 4, 2),
    ("ffn_up", False, True, "gelu", 2, False, 128, 128, 64, 4, 4, 1),
    ("ffn_down", False, False, "none", 0, True, 128, 128, 128, 4, 3, 1),
    ("ffn_down", True, False, "none", 0, True, 128, 128, 128, 4, 3, 1),
]


def label(layer, tma, fp8, act, out_q, zp, bm, bn, bk, warps, stages, epi) -> str:
    dtype = "fp8" if fp8 else ("int8 asym" if zp else "int8 sym")
    return (f"{layer} {dtype} {'TMA' if tma else 'MMA'} {bm}x{bn}x{bk} w{warps} s{stages}"
            + (f" e{epi}" if epi > 1 else ""))


def main():
    print("| variant | registers | spill stores / loads (bytes) | shared (bytes) |")
    print("|---|---|---|---|")
    for row in ROWS:
        r = compile_variant(*row[1:])
        print(f"| {label(*row)} | {r['regs']} | {r['spill_stores']} / {r['spill_loads']} | "
              f"{r['shared']} |", flush=True)


if __name__ == "__main__":
    main()
