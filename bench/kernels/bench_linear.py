"""One Linear + activation, qfuse against everything a user has today, same run.

    python -m bench.kernels.bench_linear --out $OUT/linear.json

Rows (``impl``): bf16_eager | bf16_compile | int_mm_eager | int_mm_compile | scaled_mm_eager |
scaled_mm_compile | torchao_compile | qfuse (bf16 in -> bf16 out, static activation scale) |
qfuse_q_io (quantized in -> quantized out: the layer inside a fused chain). Activations and
outputs bf16; ``hbm_bytes`` counts x, W and the output once each.

Compiled baselines are built once per (K, N) and serve every M (torch.compile's automatic
dynamic shapes: one static compile, one dynamic recompile), as a server with varying batch sees
them; qfuse likewise picks its schedule per M bucket from ``qfuse/kernels/tuned_configs.py``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from bench import baselines as B
from bench import harness as H
from bench.warm import Variant, precompile, table_jobs
from qfuse.nn import QLinear

MS = (1, 16, 64, 128, 512, 2048, 4096, 16384)
KNS = ((4096, 4096), (4096, 14336), (14336, 4096), (1024, 4096))
# Quantization error of a per-tensor static int8/fp8 activation on Gaussian data is ~1-3%.
MAX_ERR = {"bf16": 0.01, "int8": 0.05, "fp8": 0.08}
QDTYPE = {"int8": torch.int8, "fp8": B.FP8}


def qfuse_linear(w, b, x_scale, act, dtype, out_scale=None):
    """QLinear, static activation scale; with ``out_scale``: quantized input and output."""
    kw = dict(x_scale=x_scale, x_zero_point=None, activation=act, dtype=QDTYPE[dtype])
    if out_scale is not None:
        kw.update(input_quantized=True, out_dtype=QDTYPE[dtype], out_scale=out_scale)
    else:
        kw.update(out_dtype=torch.bfloat16)
    return QLinear.from_float(w, b, **kw)


class Shape:
    """Weights and compiled baselines of one (K, N), reused for every M."""

    def __init__(self, K, N, dtypes, act):
        torch._dynamo.reset()
        g = torch.Generator(device=H.DEVICE).manual_seed(K * 3 + N)
        self.K, self.N, self.act = K, N, act
        self.w = (torch.randn(N, K, device=H.DEVICE, generator=g) / K**0.5).to(torch.bfloat16)
        self.b = (torch.randn(N, device=H.DEVICE, generator=g) * 0.1).to(torch.bfloat16)
        self.q = {d: B.quantize_weight(self.w, d) for d in dtypes}
        self.fns = {}

    def fn(self, name, build):
        return B.built_once(self.fns, name, build)

    def torchao(self, dtype):
        lin = nn.Linear(self.K, self.N, device=H.DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(self.w)
            lin.bias.copy_(self.b)
        B.torchao_module([lin], dtype)
        return B.compiled(lambda t: B.ACTS[self.act](lin(t)))


def run_m(s: Shape, M, dtypes, impls):
    K, N, act, w, b = s.K, s.N, s.act, s.w, s.b
    x = torch.randn(M, K, device=H.DEVICE).to(torch.bfloat16)
    ref = B.ACTS[act](x.double() @ w.double().t() + b.double())
    flops = 2.0 * M * N * K
    rows = []

    def add(impl, dtype, in_b, w_b, out_b, call, **kw):
        if impls is not None and impl not in impls:
            return
        row = dict(workload="linear", M=M, K=K, N=N, dtype=dtype, impl=impl, act=act,
                   hbm_bytes=M * K * in_b + N * K * w_b + M * N * out_b + 8 * N)
        rows.append(H.measure(row, call, ref, flops, MAX_ERR[dtype], graph=M <= 128, **kw))

    add("bf16_eager", "bf16", 2, 2, 2, lambda: B.ACTS[act](F.linear(x, w, b)))
    bf16c = lambda: s.fn("bf16c", lambda: B.compiled(lambda t: B.ACTS[act](F.linear(t, w, b))))  # noqa: E731
    add("bf16_compile", "bf16", 2, 2, 2, lambda: bf16c()(x))
    for dtype in dtypes:
        quantized_rows(s, x, ref, dtype, add)
    return rows


def quantized_rows(s: Shape, x, ref, dtype, add):
    """The int8 or fp8 rows of one M (a function, so its lambdas bind this dtype's values)."""
    w, b, act = s.w, s.b, s.act
    wq, ws = s.q[dtype]
    xs = B.static_scale(x, dtype)
    base = "int_mm" if dtype == "int8" else "scaled_mm"
    mm = B.int_mm_linear if dtype == "int8" else B.scaled_mm_linear
    add(base + "_eager", dtype, 2, 1, 2, lambda: mm(wq, ws, b, act)(x, xs))
    comp = lambda: s.fn(base, lambda: B.compiled(mm(wq, ws, b, act)))  # noqa: E731
    add(base + "_compile", dtype, 2, 1, 2, lambda: comp()(x, xs))
    add("torchao_compile", dtype, 2, 1, 2, lambda: s.fn("ao" + dtype, lambda: s.torchao(dtype))(x))
    lin = qfuse_linear(w, b, xs, act, dtype)
    add("qfuse", dtype, 2, 1, 2, lambda: lin(x))
    out_scale = B.static_scale(ref, dtype)
    lin_q = qfuse_linear(w, b, xs, act, dtype, out_scale=out_scale)
    xq = B._q_act(x, 1.0 / xs, dtype)
    add("qfuse_q_io", dtype, 1, 1, 1, lambda: lin_q(xq), to_float=lambda o: o.float() * out_scale)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--M", type=H.ints, default=list(MS))
    p.add_argument("--KN", type=H.shapes, default=list(KNS))
    p.add_argument("--dtypes", default="int8,fp8")
    p.add_argument("--act", default="relu")
    p.add_argument("--impls", default=None, help="comma list; default all")
    p.add_argument("--out", default="bench/results/linear.json")
    a = p.parse_args(argv)
    impls = set(a.impls.split(",")) if a.impls else None
    dtypes = a.dtypes.split(",")
    variants = [Variant(f"{d}-{x}", act=a.act, quantized_out=x == "xq")
                for d in dtypes for x in ("xf", "xq")]
    precompile(table_jobs(variants, torch.cuda.get_device_name()))
    rows = []
    for K, N in a.KN:
        s = Shape(K, N, dtypes, a.act)
        for M in a.M:
            rows += run_m(s, M, dtypes, impls)
            H.add_ratios(rows, ("M", "K", "N"))
            H.write_results(a.out, rows)
            print(f"done M={M} K={K} N={N}", flush=True)
    H.print_table(rows, ("M", "K", "N"))


if __name__ == "__main__":
    main()
