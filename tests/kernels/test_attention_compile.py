"""Compile ``kernels.attention`` for Hopper (sm_90) without a GPU (see
tests/kernels/test_compile.py for why the interpreter is not enough): the table's largest
schedules, int8 and fp8 outputs, boolean and additive masks. Runs in a child process with the
interpreter off."""

from __future__ import annotations

import json
import os

import pytest

from tests.kernels.test_compile import run_child

CHILD = os.environ.get("QFUSE_COMPILE_CHILD") == "1"


def variants():
    """(dtype, OUT, MASK, head_dim, schedule): head dims 64 and 128 with their largest
    schedules, int8 with a boolean mask and fp8 with an additive one (each compile costs ~4 s of
    the CI's CPU; the bf16 output and no-mask branches are the simplest)."""
    from qfuse.kernels.attention.encoder import SCHEDULES

    out = []
    for i, d in enumerate(sorted({d for d, _ in SCHEDULES if d >= 64})):  # 32: 64's code
        s = max((s for (dd, _), s in SCHEDULES.items() if dd == d),
                key=lambda s: (s.block_m * s.block_n, s.num_stages))
        out.append(("bf16", i + 1, i + 1, d,
                    (s.block_m, s.block_n, s.num_warps, s.num_stages)))
    return out


def child_main() -> None:
    from qfuse.kernels.attention import encoder as attention
    from tests.kernels.test_compile import compile_sm90

    results = []
    for dtype, out_code, mask, d, (bm, bn, warps, stages) in variants():
        outp = {0: f"*{dtype}", 1: "*i8", 2: "*fp8e4nv"}[out_code]
        ptrs = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}",
                    mask_ptr="*i1" if mask == 1 else f"*{dtype}", inv_scale_ptr="*fp32",
                    zp_ptr="*i32", out_ptr=outp)
        mant, emin = (7, -126) if dtype == "bf16" else (0, 0)
        constexprs = dict(QK_SCALE=0.125 * attention.LOG2E, MASK=mask, OUT=out_code,
                          HAS_ZP=out_code == 1, Y_MANT=mant, Y_EMIN=emin, EXACT=False,
                          IEEE=dtype == "fp32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d)
        kernel = compile_sm90(attention._attention_kernel, ptrs, constexprs, num_warps=warps,
                              num_stages=stages)
        ptx = kernel.asm["ptx"]
        results.append({"shared": kernel.metadata.shared, "mma": "mma" in ptx,
                        "spills": getattr(kernel, "n_spills", 0)})
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    return run_child(__file__)


def test_every_schedule_compiles_and_fits(compiled):
    assert len(compiled) == len(variants())
    for info in compiled:
        assert info["shared"] <= 232448, "more shared memory than an H100/H200 block may have"
        assert info["mma"], "the attention dots must run on the tensor cores"


if __name__ == "__main__":
    child_main()
