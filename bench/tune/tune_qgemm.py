"""Autotune ``_qlinear_kernel`` over the benchmark shapes; write the table ``tuned_configs`` ships.

    python -m bench.tune.tune_qgemm --out tuning.json --timings timings.json

Compiling the candidates dominates (1-3 s each, one process), so ``warm.precompile`` compiles
them all in parallel first. Copy the printed table into ``qfuse/kernels/tuned_configs.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from bench.kernels.bench_linear import KNS, MS
from bench.warm import Variant, make_args, precompile
from qfuse.kernels import schedules, tuning
from qfuse.kernels.gemm import dispatch as qgemm

KINDS = ("int8-xf", "int8-xq", "fp8-xf", "fp8-xq")
# bench_linear's shapes plus the MLP's second layer at d=1024 (K=h=4096, N=d=1024).
SHAPES = (*KNS, (4096, 1024))


def variant(kind: str) -> Variant:
    """The benchmark's epilogue: bias + ReLU; float x -> bf16 out, quantized x -> quantized out."""
    return Variant(kind, quantized_out=kind.endswith("xq"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="tuning.json")
    p.add_argument("--timings", default="timings.json")
    p.add_argument("--workers", type=int, default=12)
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = torch.cuda.get_device_name()
    precompile([(variant(kind), dataclasses.asdict(cfg))
                for kind, (K, N), M in itertools.product(KINDS, SHAPES, MS)
                for cfg in schedules.candidates(M, N, K, kind, sms)], a.workers)
    table, timings = {}, []
    for kind, (K, N), M in itertools.product(KINDS, SHAPES, MS):
        key = tuning.cache_key(gpu, kind, M, N, K)
        if key in table:
            continue
        report = []
        args = make_args(variant(kind), M, K, N)
        best = tuning.autotune(lambda cfg, a=args: qgemm.qlinear(**a, config=cfg),
                               schedules.candidates(M, N, K, kind, sms), report)
        table[key] = dataclasses.asdict(best)
        for cfg, us in report:
            timings.append(dict(kind=kind, M=M, K=K, N=N, cfg=dataclasses.asdict(cfg), ms=us))
        best_ms = min(u for _, u in report if isinstance(u, float))
        tops = 2 * M * N * K / best_ms / 1e9
        print(f"{kind} M={M} K={K} N={N}: {best_ms * 1e3:.1f} us {tops:.0f} TOPS {best}",
              flush=True)
    with open(a.out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    with open(a.timings, "w") as f:
        json.dump(timings, f)


if __name__ == "__main__":
    main()
