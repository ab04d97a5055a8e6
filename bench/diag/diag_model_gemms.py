"""Where a converted encoder's GEMM time goes, kernel by kernel, with each launch's grid.

    python -m bench.diag.diag_model_gemms [--model bert-base] [--batch 32]

``bench_models.py`` gives the quantized GEMMs' total per forward; ``encoder_gemms.py`` times
each layer's GEMM alone. When the two disagree, this says which layer's kernel is slower inside
the model and what ran there: the profiler's trace of one graphed forward (compiled, replayed
from a CUDA graph, as the "graph" rows run) gives every kernel's GPU time, grid, block,
registers and shared memory. The encoder's GEMMs come in a fixed order per layer (Q/K/V, the
attention output, FFN up, FFN down), so the n-th quantized GEMM of a forward is layer n // 4 of
kind n % 4.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch

import qfuse
from bench import harness
from bench.models import bench_models as BM

KINDS = ("qkv", "attn_out", "ffn_up", "ffn_down")


def trace_kernels(fn, calls: int = 3) -> list[dict]:
    """Every CUDA kernel of ``calls`` calls of ``fn``: name, µs, grid, block, regs, smem."""
    prof = harness.profiled(fn, calls)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        out.append(dict(name=e["name"], us=float(e["dur"]), ts=float(e["ts"]),
                        grid=tuple(a.get("grid", ())), block=tuple(a.get("block", ())),
                        regs=a.get("registers per thread"), smem=a.get("shared memory")))
    out.sort(key=lambda k: k["ts"])
    return out


def per_kind(kernels: list[dict], calls: int) -> dict:
    gemms = [k for k in kernels if "_qlinear" in k["name"] or "_gated" in k["name"]]
    per_call = len(gemms) // calls
    stats: dict = defaultdict(lambda: dict(us=0.0, n=0, launch=set()))
    for i, k in enumerate(gemms):
        kind = KINDS[(i % per_call) % 4]
        s = stats[kind]
        s["us"] += k["us"]
        s["n"] += 1
        s["launch"].add((k["name"][:40], k["grid"], k["block"], k["regs"], k["smem"]))
    return {kind: dict(mean_us=round(s["us"] / s["n"], 2), n=s["n"] // calls,
                       launches=sorted(s["launch"]))
            for kind, s in stats.items()}


def others(kernels: list[dict], calls: int, top: int = 12) -> list[tuple[str, float, int]]:
    agg: dict = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        agg[k["name"][:70]][0] += k["us"] / calls
        agg[k["name"][:70]][1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return [(n, round(us, 1), c // calls) for n, (us, c) in rows]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--configs", default="int8,fp8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bf16 = BM.build(a.model, torch.bfloat16, "cuda")
    inp = BM.tokens(a.batch, "cuda")
    result = harness.environment() | {"model": a.model, "batch": a.batch}
    cfgs = {"int8": qfuse.QConfig(symmetric=False), "int8sym": qfuse.QConfig(),
            "fp8": qfuse.QConfig.fp8_static()}
    for name in a.configs.split(","):
        model = BM.qfuse_model(bf16, cfgs[name], "cuda")
        torch._dynamo.reset()
        compiled = torch.compile(model)
        replay = harness.graphed(lambda c=compiled: c(**inp))
        calls = 3
        kernels = trace_kernels(replay, calls)
        eager_kernels = trace_kernels(lambda m=model: m(**inp), calls)
        result[name] = dict(graph=per_kind(kernels, calls), eager=per_kind(eager_kernels, calls),
                            top=others(kernels, calls))
        print(f"\n== {a.model} batch {a.batch} qfuse {name}: per GEMM kind, mean GPU µs")
        for kind in KINDS:
            g, e = result[name]["graph"].get(kind), result[name]["eager"].get(kind)
            if g is None:
                continue
            print(f"  {kind:9s} graph {g['mean_us']:7.2f} eager {e['mean_us'] if e else '-':>7} "
                  f"x{g['n']}  {g['launches']}")
        print("  top kernels (graph):")
        for n, us, c in result[name]["top"]:
            print(f"    {us:8.1f} µs  x{c:<3d} {n}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=list)


if __name__ == "__main__":
    main()
