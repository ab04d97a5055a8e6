"""A/B of epilogue schedules on the MLP's first GEMM (M=16384, K=4096, N=14336, int8/fp8 in/out).

    python -m bench.kernels.epilogue_ab

ReLU shows the GEMM alone; GELU adds the heavy epilogue. The tile shape and ``epi_split`` rows are
the evidence behind ``schedules.for_epilogue``.
"""

from __future__ import annotations

import dataclasses

import torch

from bench import harness as H
from bench.warm import Variant, make_args, precompile
from qfuse.kernels.gemm import dispatch as qgemm
from qfuse.kernels.schedules import GemmConfig

M, K, N = 16384, 4096, 14336
CONFIGS = [
    GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 128, num_warps=8, num_stages=3, epi_split=2),
    GemmConfig(256, 128, 128, num_warps=8, num_stages=3, epi_split=2),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4, epi_split=2),
]


def main():
    variants = [Variant(f"{d}-xq", act=a, quantized_out=True) for d in ("int8", "fp8")
                for a in ("relu", "gelu")]
    precompile([(v, dataclasses.asdict(c)) for v in variants for c in CONFIGS])
    for v in variants:
        args = make_args(v, M, K, N)
        for c in CONFIGS:
            us = H.median_us(lambda c=c, a=args: qgemm.qlinear(**a, config=c))
            tops = 2 * M * N * K / us / 1e6
            print(f"{v.kind:8s} {v.act:5s} {c.block_m}x{c.block_n} st{c.num_stages} "
                  f"epi{c.epi_split}: {us:8.1f} us {tops:6.0f} TOPS", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
