"""Routing's cost model against measurement: per GEMM shape, bf16 / fused int8 / fused fp8
timed on this GPU (``CostModel.measure``: do_bench medians, random data, each kernel checked
against a float reference before it is timed) next to the analytic roofline, and whether the
two pick the same implementation.

    python -m bench.tune.route_costs --out $OUT/route_costs.json

Shapes: all-MiniLM-L6-v2's Linear layers (K, N = 384/1536) and a 10-class head at decode,
mid and batch sizes; an 8B-class MLP's two GEMMs at decode and prefill sizes.
"""

from __future__ import annotations

import argparse

from bench.harness import write_results
from qfuse.analysis.routing import IMPLS, CostModel, analytic_us, choose

KN = {
    "minilm qkv/attn-out": (384, 384),
    "minilm intermediate": (384, 1536),
    "minilm output": (1536, 384),
    "head 10": (384, 10),
    "mlp up": (4096, 14336),
    "mlp down": (14336, 4096),
}
TOKENS = {
    "minilm qkv/attn-out": (16, 512, 4096),
    "minilm intermediate": (16, 512, 4096),
    "minilm output": (16, 512, 4096),
    "head 10": (16, 4096),
    "mlp up": (16, 2048, 16384),
    "mlp down": (16, 2048, 16384),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/route_costs.json")
    args = parser.parse_args()
    model = CostModel()
    shapes = [(M, *KN[name]) for name, ms in TOKENS.items() for M in ms]
    model.measure(shapes)
    rows, agree = [], 0
    header = f"{'layer':<22}{'M':>6} " + "".join(
        f"{i + ' meas':>11}{i + ' roof':>11}" for i in IMPLS
    )
    print(header + "  pick (measured / analytic)")
    for name, ms in TOKENS.items():
        K, N = KN[name]
        for M in ms:
            meas = {i: model.predict_us(i, M, K, N)[0] for i in IMPLS}
            roof = {i: analytic_us(i, M, K, N, model.rates) for i in IMPLS}
            pick_m, pick_a = choose(meas, "int8"), choose(roof, "int8")
            agree += pick_m == pick_a
            rows.append(
                dict(
                    layer=name,
                    M=M,
                    K=K,
                    N=N,
                    measured_us=meas,
                    analytic_us=roof,
                    pick_measured=pick_m,
                    pick_analytic=pick_a,
                )
            )
            cells = "".join(f"{meas[i]:>11.1f}{roof[i]:>11.1f}" for i in IMPLS)
            print(f"{name:<22}{M:>6} {cells}  {pick_m} / {pick_a}")
    print(f"analytic pick = measured pick on {agree} of {len(rows)} shapes (int8 config)")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
