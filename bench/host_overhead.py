"""Where a small qfuse forward spends host time: each layer of the call path, timed alone.

    PYTHONPATH=. python bench/host_overhead.py

At decode sizes the kernel takes ~10-25 us on an H200, so microseconds of Python per call decide
whether the GPU idles. Each line is ``harness.host_us``: the CPU time to issue one call while the
GPU is held busy.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import harness as H  # noqa: E402

from qfuse.kernels import qgemm  # noqa: E402
from qfuse.kernels.tuning import pick_config  # noqa: E402
from qfuse.nn import QLinear  # noqa: E402


def main():
    M, K, N = 16, 4096, 14336
    w = torch.randn(N, K, device="cuda") / K**0.5
    lin = QLinear.from_float(w, None, x_scale=torch.tensor(0.02), x_zero_point=None,
                             activation="relu", input_quantized=True, out_dtype=torch.int8,
                             out_scale=torch.tensor(0.1, device="cuda"))
    x = torch.randint(-100, 100, (M, K), device="cuda", dtype=torch.int8)
    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wb = w.to(torch.bfloat16)
    args = (x, lin.weight, lin.scale, None, None, None, None, None, lin.out_inv_scale, None,
            "relu", torch.int8)
    cfg = pick_config(M, N, K, "int8-xq", x.device, False)
    out = torch.empty(M, N, device="cuda", dtype=torch.int8)
    launch_args = (x, lin.weight, lin.scale, None, None, None, None, None, None,
                   lin.out_inv_scale, None, "relu", out, cfg)
    paths = {
        "torch F.linear bf16 (reference point)": lambda: F.linear(xb, wb),
        "QLinear module (eager fast path)": lambda: lin(x),
        "torch.ops.qfuse.qlinear (dispatcher)": lambda: torch.ops.qfuse.qlinear(*args),
        "kernels.qgemm.qlinear (wrapper)": lambda: qgemm.qlinear(*args),
        "kernels.qgemm.launch (Triton JIT launch)": lambda: qgemm.launch(*launch_args),
    }
    ref = lin(x)
    for name, fn in paths.items():
        fn()
        us = min(H.host_us(fn) for _ in range(3))
        print(f"{name:45s} {us:7.1f} us host", flush=True)
    assert torch.equal(lin(x), ref)


if __name__ == "__main__":
    main()
