"""Compile qfuse kernel variants in parallel before a benchmark times them.

Triton compiles each (constexprs, schedule) once, 1-3 s each in one process; a benchmark over
many shapes meets dozens. A spawn pool runs each variant once on small inputs with the same
integer specializations (every dimension a multiple of 16, K >= 1024 so the quantize pass picks
the same block), which fills Triton's on-disk cache; the timed process then only loads cubins.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import time

import torch

from bench import harness as H
from qfuse.kernels.gemm.call import GemmCall

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Variant:
    """One call pattern of ``dispatch.qlinear``: kind ("int8-xf", "fp8-xq", ...), epilogue, x
    mode."""

    kind: str
    act: str = "relu"
    residual: bool = False
    quantized_out: bool = False
    dynamic: bool = False
    fast_act: bool = False  # hardware erf/exp GELU/SiLU epilogue (the GPU default in QLinear)
    # int8 with zero points, as an asymmetric static model runs it: x's zero point folded into
    # the bias by nn.QLinear (no weight_sum), the requantized output's zero point in the kernel
    asym: bool = False

    @property
    def table_kind(self) -> str:
        """The schedule kind it runs with: a dynamic float x is quantized before the GEMM."""
        return self.kind.replace("-xf", "-xq") if self.dynamic else self.kind


def make_args(v: Variant, M: int, K: int, N: int, device="cuda") -> dict:
    """``dispatch.qlinear``'s (and ``reference.qlinear``'s) arguments for ``v`` at this shape:
    ``x``, the layer's ``call``, ``x_scale`` and ``residual``."""
    qdtype = FP8 if v.kind.startswith("fp8") else torch.int8
    zp = v.asym and qdtype == torch.int8
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    if v.kind.endswith("xq"):
        x = (x * 20).clamp(-127, 127).to(qdtype)
    w = (torch.randn(N, K, device=device) * 20).clamp(-127, 127).to(qdtype)
    one = torch.ones((), device=device)
    return H.call_args(GemmCall, dict(
        x=x, weight=w, scale=torch.rand(N, device=device) * 1e-4,
        bias=torch.randn(N, device=device),
        x_inv_scale=one * 20 if v.kind.endswith("xf") and not v.dynamic else None,
        x_zero_point=torch.tensor(3, dtype=torch.int32, device=device) if zp else None,
        weight_sum=None,
        residual=torch.randn(M, N, device=device).to(torch.bfloat16) if v.residual else None,
        out_inv_scale=one if v.quantized_out else None,
        out_zero_point=(torch.tensor(-7, dtype=torch.int32, device=device)
                        if zp and v.quantized_out else None),
        act=v.act,
        out_dtype=qdtype if v.quantized_out else torch.bfloat16,
        x_scale=torch.rand(M, device=device) if v.dynamic and v.kind.endswith("xq") else None,
        fast_act=v.fast_act,
    ))


def _compile_one(job):
    from qfuse.kernels.gemm import dispatch as qgemm
    from qfuse.kernels.schedules import GemmConfig

    variant, cfg = job
    try:
        qgemm.qlinear(**make_args(variant, 16, 1024, 256), config=GemmConfig(**cfg))
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 — reported, the timing loop skips it too
        return f"{variant} {cfg}: {str(exc)[:150]}"


def precompile(jobs, workers: int = 12) -> list[str]:
    """Compile every ``(Variant, GemmConfig-as-dict)`` job; returns the error messages."""
    jobs = list(dict.fromkeys((v, tuple(sorted(c.items()))) for v, c in jobs))
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_compile_one, [(v, dict(c)) for v, c in jobs]) if e]
    print(f"precompiled {len(jobs)} kernel variants in {time.time() - t0:.0f} s, "
          f"{len(errors)} failed", flush=True)
    for e in errors[:5]:
        print("  ", e, flush=True)
    return errors


def table_jobs(variants, gpu: str) -> list:
    """Jobs for every tuned schedule of this GPU whose kind matches a variant."""
    from qfuse.kernels.schedules import GemmConfig, for_epilogue
    from qfuse.kernels.tuned_configs import TUNED

    jobs = []
    for key, row in TUNED.items():
        key_gpu, kind = key.split("|")[:2]
        if key_gpu != gpu:
            continue
        for v in variants:
            if v.table_kind == kind:
                cfg = for_epilogue(GemmConfig(**row), v.act not in ("none", "relu"))
                jobs.append((v, dataclasses.asdict(cfg)))
    return jobs
