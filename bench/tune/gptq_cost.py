"""What GPTQ rounding costs at convert time, per layer shape, on this machine's device.

    python -m bench.tune.gptq_cost            # CUDA when present

Times ``qfuse.algorithms.gptq.gptq_round`` (median of 3) for int8 and fp8 on random correlated
Hessians, and reports how much it lowers the output error ``|(W - Q) X|`` relative to
round-to-nearest.
Writes JSON (device, versions, commit, rows) to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.harness import write_results
from qfuse.algorithms.gptq import GPTQ, gptq_round
from qfuse.primitives import weight_codes, weight_scale

SHAPES = [(384, 384), (1536, 384), (384, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]


def run(device: torch.device, shapes) -> list[dict]:
    rows = []
    for n, k in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(4 * k, k, device=device, generator=g)
        x = x @ (torch.randn(k, k, device=device, generator=g) / k**0.5) + 0.3 * x
        h = x.T @ x / x.shape[0]
        w = torch.randn(n, k, device=device, generator=g) * 0.02
        for dtype in (torch.int8, torch.float8_e4m3fn):
            s = weight_scale(w, dtype, per_channel=True)
            times = []
            for _ in range(3):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                q = gptq_round(w, h, s, dtype, GPTQ())
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            rtn = weight_codes(w, torch.reciprocal(s)[:, None], dtype) * s[:, None]
            probe = x[: 2 * k]
            ratio = ((q - w) @ probe.T).norm() / ((rtn - w) @ probe.T).norm()
            rows.append(
                dict(
                    n=n,
                    k=k,
                    dtype=str(dtype).replace("torch.", ""),
                    seconds=statistics.median(times),
                    error_vs_rtn=ratio.item(),
                )
            )
            print(
                f"{n:>6} x {k:<6} {rows[-1]['dtype']:<14} {rows[-1]['seconds']:8.2f} s   "
                f"output error {ratio.item():.3f} x RTN",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/gptq_cost.json")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="first N shapes only")
    args = parser.parse_args()
    write_results(args.out, run(torch.device(args.device), SHAPES[: args.shapes]))


if __name__ == "__main__":
    main()
