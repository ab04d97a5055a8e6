"""Host time per fused Linear in plain eager, against ``F.linear`` in the same run.

    python -m bench.diag.host_overhead [--out $OUT/host_overhead.json]

At decode sizes the kernel takes ~10-25 us on an H200, so microseconds of Python per call decide
whether the GPU idles. Each number is ``harness.host_us``: the CPU time to issue one call while the
GPU is held busy. Target (issue 10): the module's eager call within 1.5x of ``F.linear``'s.
Cases: int8 handed over (decode MLP, M=16), float input quantized in the prologue (M=16), and
BERT-sized float input with a separate quantize pass (M=4096, d 768 -> 3072, GELU).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench import harness as H
from qfuse.kernels.gemm import dispatch as qgemm
from qfuse.nn import QLinear


def case(M, K, N, act, x_quantized, dtype=torch.int8):
    w = torch.randn(N, K, device="cuda") / K**0.5
    lin = QLinear.from_float(w, None, x_scale=torch.tensor(0.02), x_zero_point=None,
                             dtype=dtype, activation=act, input_quantized=x_quantized,
                             out_dtype=dtype if x_quantized else torch.bfloat16,
                             out_scale=torch.tensor(0.1) if x_quantized else None).cuda()
    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x = (xb * 50).clamp(-127, 127).to(dtype) if x_quantized else xb
    wb = w.to(torch.bfloat16)
    bias = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    call = lin.describe()  # the layer's call, as its forward builds it
    op_args = call.op_args(x)
    paths = {
        "F.linear bf16": lambda: F.linear(xb, wb, bias),
        "QLinear eager (cached launch)": lambda: lin(x),
        "qgemm.qlinear (Triton's launch)": lambda: qgemm.qlinear(x, call),
        "torch.ops.qfuse.qlinear (dispatcher)": lambda: torch.ops.qfuse.qlinear(*op_args),
    }
    ref = lin(x)
    out = {}
    for name, fn in paths.items():
        fn()
        out[name] = min(H.host_us(fn) for _ in range(5))
    assert torch.equal(lin(x).view(torch.uint8) if dtype != torch.int8 else lin(x),
                       ref.view(torch.uint8) if dtype != torch.int8 else ref)
    out["launch_mode"] = lin.launch_mode
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cases = {
        "int8 in/out, M16 4096x14336 relu": (16, 4096, 14336, "relu", True),
        "float in, M16 4096x4096 none": (16, 4096, 4096, "none", False),
        "float in, M4096 768x3072 gelu": (4096, 768, 3072, "gelu", False),
        "fp8 in/out, M16 4096x14336 relu": (16, 4096, 14336, "relu", True, torch.float8_e4m3fn),
    }
    rows = []
    for name, c in cases.items():
        r = case(*c)
        base = r["F.linear bf16"]
        print(f"\n{name}  ({r['launch_mode']})")
        for k, v in r.items():
            if k != "launch_mode":
                print(f"  {k:40s} {v:7.1f} us host  ({v / base:4.2f}x F.linear)")
        rows.append(dict(case=name, **r))
    if a.out:
        H.write_results(a.out, rows)


if __name__ == "__main__":
    main()
