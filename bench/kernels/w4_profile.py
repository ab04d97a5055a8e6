"""Where a 4-bit decode GEMM's time goes: one TinyLlama role's GEMM at M = 1 in W4A16 (the
one-row schedule, ``pick_config``) and in int8 (decode_chain's autotuned pick), each launched a
few times eagerly, for Nsight Compute to read the hardware counters of one launch of each
(issue #36), and the kernels' torch.profiler times printed beside them.

    ncu --clock-control none --nvtx --nvtx-include "w4profile/" -k regex:"_w4_kernel|_qlinear" \\
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python -m bench.kernels.w4_profile --role gate_up --impl w4a16 --ncu   (GPU)
    python -m bench.kernels.w4_profile --role gate_up --impl both          (GPU, times only)
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernels import decode_chain as dc
from bench.kernels import w4_chain as wc


def launches(role: str, impl: str, reps: int, ncu: bool = False):
    """``reps`` launches of ``role``'s GEMM (layer 0's weights) to warm up (and autotune),
    ``reps`` more inside the NVTX range ``w4profile`` (what ncu reads), then, without ``ncu``,
    the profiler's mean kernel times over ``reps`` more."""
    from qfuse.kernels.gemm import dispatch as qgemm
    from qfuse.kernels.gemm.w4 import w4_gemm

    int8 = dc.build_layers(1, "int8", "cuda", False)[:1]
    attr = wc.ATTRS[role]
    c8 = getattr(int8[0], attr)
    K = c8.weight.shape[1]
    x = (torch.randn(1, K) * 0.5).to(torch.bfloat16).cuda()
    n_out = c8.weight.shape[0] // (2 if c8.act == "swiglu" else 1)
    res = torch.randn(1, n_out).to(torch.bfloat16).cuda() if role in ("o_proj", "down") else None
    fns = {}
    if impl in ("w4a16", "both"):
        c4 = getattr(wc.w4_layers(int8, wc.GROUP)[0], attr)
        fns["w4a16"] = lambda: w4_gemm(x, c4.weight, c4.scale, c4.zero, c4.bias, c4.in_features,
                                       c4.group_size, c4.act, 16, None, None, res,
                                       torch.bfloat16)
    if impl in ("int8", "both"):
        fns["int8"] = lambda: qgemm.qlinear(x, c8, residual=res)
    out = {}
    for name, fn in fns.items():
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("w4profile")
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        if ncu:  # ncu owns the profiling interface
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kern = {}
        for e in ev:
            kern.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        out[name] = {k: sum(v) / len(v) for k, v in kern.items()}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=list(wc.ATTRS), default="gate_up")
    ap.add_argument("--impl", choices=("w4a16", "int8", "both"), default="both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ncu", action="store_true", help="run under ncu: no torch.profiler")
    a = ap.parse_args(argv)
    print(json.dumps({"role": a.role, "kernel_us": launches(a.role, a.impl, a.reps, a.ncu)}))


if __name__ == "__main__":
    main()
