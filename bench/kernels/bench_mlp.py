"""Transformer MLP block ``Linear(d->h) -> GELU -> Linear(h->d) -> + x``, qfuse vs today, same run.

    python -m bench.kernels.bench_mlp --out $OUT/mlp.json

qfuse (static): two fused kernels, int8/fp8 between them — the first quantizes x (in its
prologue, or a separate pass from M=128 on), applies bias + GELU and requantizes h with the second
layer's static scale; the second adds bias and the residual and writes bf16.
qfuse_dynamic: per-token scales at run time — each layer quantizes its input in a separate pass
(a row's scale needs the whole row), h travels as bf16: four launches.
Baselines as in bench_linear; ``hbm_bytes`` = x, W1, W2, h written and read once, residual, out.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from bench import baselines as B
from bench import harness as H
from bench.kernels.bench_linear import MAX_ERR, QDTYPE
from bench.warm import Variant, precompile, table_jobs
from qfuse.nn import QLinear

MS = (16, 128, 2048, 16384)
DHS = ((4096, 14336), (1024, 4096))


def variants(dtypes):
    out = []
    for d in dtypes:
        out += [Variant(f"{d}-xf", act="gelu", quantized_out=True),
                Variant(f"{d}-xq", act="none", residual=True),
                Variant(f"{d}-xf", act="gelu", dynamic=True),
                Variant(f"{d}-xf", act="none", residual=True, dynamic=True)]
    return out


class Block:
    """Weights and compiled baselines of one (d, h), reused for every M."""

    def __init__(self, d, h, dtypes):
        torch._dynamo.reset()
        g = torch.Generator(device=H.DEVICE).manual_seed(d + h)
        self.d, self.h = d, h
        self.w1 = (torch.randn(h, d, device=H.DEVICE, generator=g) / d**0.5).to(torch.bfloat16)
        self.b1 = (torch.randn(h, device=H.DEVICE, generator=g) * 0.1).to(torch.bfloat16)
        self.w2 = (torch.randn(d, h, device=H.DEVICE, generator=g) / h**0.5).to(torch.bfloat16)
        self.b2 = (torch.randn(d, device=H.DEVICE, generator=g) * 0.1).to(torch.bfloat16)
        self.q = {t: (B.quantize_weight(self.w1, t), B.quantize_weight(self.w2, t)) for t in dtypes}
        self.fns = {}

    def eager(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2) + x

    def mm(self, dtype):
        """_int_mm / _scaled_mm MLP with static scales (x_scale, h_scale are arguments)."""
        (w1q, s1), (w2q, s2) = self.q[dtype]
        mm = B.int_mm_linear if dtype == "int8" else B.scaled_mm_linear
        l1, l2 = mm(w1q, s1, self.b1, "gelu"), mm(w2q, s2, self.b2, "none")
        return lambda x, xs, hs: l2(l1(x, xs), hs) + x

    def torchao(self, dtype):
        l1 = nn.Linear(self.d, self.h, device=H.DEVICE, dtype=torch.bfloat16)
        l2 = nn.Linear(self.h, self.d, device=H.DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            for lin, w, b in ((l1, self.w1, self.b1), (l2, self.w2, self.b2)):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
        B.torchao_module([l1, l2], dtype)
        return B.compiled(lambda x: l2(F.gelu(l1(x))) + x)

    def qfuse(self, dtype, xs, hs):
        q = QDTYPE[dtype]
        l1 = QLinear.from_float(self.w1, self.b1, x_scale=xs, x_zero_point=None, dtype=q,
                                activation="gelu", out_dtype=q, out_scale=hs)
        l2 = QLinear.from_float(self.w2, self.b2, x_scale=hs, x_zero_point=None, dtype=q,
                                input_quantized=True, out_dtype=torch.bfloat16)
        return lambda x: l2(l1(x), x)

    def qfuse_dynamic(self, dtype):
        q = QDTYPE[dtype]
        l1 = QLinear.from_float(self.w1, self.b1, x_scale=None, x_zero_point=None, dtype=q,
                                activation="gelu", out_dtype=torch.bfloat16)
        l2 = QLinear.from_float(self.w2, self.b2, x_scale=None, x_zero_point=None, dtype=q,
                                out_dtype=torch.bfloat16)
        return lambda x: l2(l1(x), x)

    def cached(self, name, build):
        return B.built_once(self.fns, name, build)


def run_m(blk: Block, M, dtypes, impls):
    d, h = blk.d, blk.h
    x = torch.randn(M, d, device=H.DEVICE).to(torch.bfloat16)
    h_ref = F.gelu(x.double() @ blk.w1.double().t() + blk.b1.double())
    ref = h_ref @ blk.w2.double().t() + blk.b2.double() + x.double()
    flops = 4.0 * M * d * h
    rows = []

    def add(impl, dtype, w_b, h_b, call):
        if impls is not None and impl not in impls:
            return
        row = dict(workload="mlp", M=M, d=d, h=h, dtype=dtype, impl=impl, act="gelu",
                   hbm_bytes=3 * 2 * M * d + 2 * d * h * w_b + 2 * M * h * h_b)
        rows.append(H.measure(row, call, ref, flops, MAX_ERR[dtype], graph=M <= 128))

    add("bf16_eager", "bf16", 2, 2, lambda: blk.eager(x))
    add("bf16_compile", "bf16", 2, 2, lambda: blk.cached("bf16c", lambda: B.compiled(
        blk.eager))(x))
    for dtype in dtypes:
        quantized_rows(blk, x, h_ref, dtype, add)
    return rows


def quantized_rows(blk: Block, x, h_ref, dtype, add):
    """The int8 or fp8 rows of one M (a function, so its lambdas bind this dtype's values)."""
    xs, hs = B.static_scale(x, dtype), B.static_scale(h_ref, dtype)
    base = "int_mm" if dtype == "int8" else "scaled_mm"
    mm = blk.mm(dtype)
    add(base + "_eager", dtype, 1, 1, lambda: mm(x, xs, hs))
    add(base + "_compile", dtype, 1, 1,
        lambda: blk.cached(base, lambda: B.compiled(blk.mm(dtype)))(x, xs, hs))
    add("torchao_compile", dtype, 1, 2,
        lambda: blk.cached("ao" + dtype, lambda: blk.torchao(dtype))(x))
    fused = blk.qfuse(dtype, xs, hs)
    add("qfuse", dtype, 1, 1, lambda: fused(x))
    dyn = blk.qfuse_dynamic(dtype)
    add("qfuse_dynamic", dtype, 1, 2, lambda: dyn(x))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--M", type=H.ints, default=list(MS))
    p.add_argument("--DH", type=H.shapes, default=list(DHS))
    p.add_argument("--dtypes", default="int8,fp8")
    p.add_argument("--impls", default=None, help="comma list; default all")
    p.add_argument("--out", default="bench/results/mlp.json")
    a = p.parse_args(argv)
    impls = set(a.impls.split(",")) if a.impls else None
    dtypes = a.dtypes.split(",")
    precompile(table_jobs(variants(dtypes), torch.cuda.get_device_name()))
    rows = []
    for d, h in a.DH:
        blk = Block(d, h, dtypes)
        for M in a.M:
            rows += run_m(blk, M, dtypes, impls)
            H.add_ratios(rows, ("M", "d", "h"))
            H.write_results(a.out, rows)
            print(f"done M={M} d={d} h={h}", flush=True)
    H.print_table(rows, ("M", "d", "h"))


if __name__ == "__main__":
    main()
