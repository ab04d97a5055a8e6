"""Where plain-eager time goes in a whole encoder: GPU kernels and host operators per forward.

    python -m bench.diag.diag_eager [--model minilm-l6] [--batch 32]

Eager encoders are host-bound on the device machines (MiniLM-L6 32x128 on an H100: 5.8 ms a
forward for 0.56 ms of GPU work in bf16, 89 kernels; qfuse int8 6.4 ms for 0.55 ms, 94
kernels), so a qfuse model is faster eagerly only if its forward costs less host time than
transformers' own. For bf16 and qfuse int8 (asymmetric static, as bench_models.py builds them)
this prints the wall time per forward, the kernels per forward (count, GPU µs, name) and the
host operators with the most self CPU time per forward.
"""

from __future__ import annotations

import argparse

import torch

import qfuse
from bench import harness
from bench.models import bench_models as bm


def report(label: str, fn, calls: int = 5) -> None:
    print(f"\n== {label}: {harness.wall_us(fn, warmup=3):.0f} us wall per forward")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu.sort(key=lambda e: -e.count)
    print(f"  kernels per forward: {sum(e.count for e in gpu) / calls:.0f}")
    for e in gpu[:16]:
        print(f"    {e.count / calls:5.1f}x {e.self_device_time_total / calls:8.1f} us  "
              f"{e.key[:100]}")
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    host.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in host) / calls
    print(f"  host ops: {total:.0f} us self CPU per forward (profiler-inflated)")
    for e in host[:16]:
        print(f"    {e.count / calls:5.1f}x {e.self_cpu_time_total / calls:8.1f} us  "
              f"{e.key[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    model = bm.build(args.model, torch.bfloat16, "cuda")
    inputs = bm.tokens(args.batch, "cuda")
    with torch.no_grad():
        report(f"{args.model} {args.batch}x{bm.SEQ} bf16 eager", lambda: model(**inputs))
        qmodel = bm.qfuse_model(model, qfuse.QConfig(symmetric=False), "cuda")
        report(f"{args.model} {args.batch}x{bm.SEQ} qfuse int8 eager", lambda: qmodel(**inputs))


if __name__ == "__main__":
    main()
