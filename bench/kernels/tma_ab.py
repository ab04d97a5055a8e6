"""The encoder GEMMs on a short list of schedules: the MMA family's winners, the TMA family's
one-tile and persistent forms; plus, for the FFN-up GEMM,
the same schedule with lighter epilogues, so the epilogue's share of its time is measured.

    python -m bench.kernels.tma_ab [--M 4096] [--out $OUT/tma_ab.json]

Each row checks every schedule against the CPU reference before timing it (``encoder_gemms``).
"""

from __future__ import annotations

import argparse
import dataclasses

from bench import harness as H
from bench.kernels import encoder_gemms as E
from bench.warm import Variant, precompile
from qfuse.kernels.schedules import GemmConfig

MMA = [GemmConfig(128, 128, 64, num_warps=4, num_stages=3),
       GemmConfig(128, 128, 64, num_warps=4, num_stages=4, epi_split=2),
       GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
       GemmConfig(128, 256, 128, num_warps=8, num_stages=3)]
TMA = [GemmConfig(128, 128, 128, num_warps=4, num_stages=3, tma=True),
       GemmConfig(64, 128, 128, num_warps=4, num_stages=4, tma=True),
       GemmConfig(128, 128, 64, num_warps=4, num_stages=4, tma=True)]
PERSISTENT_TMA = [GemmConfig(128, 128, 64, num_warps=4, num_stages=4, tma=True, persistent=True),
                  GemmConfig(128, 128, 128, num_warps=8, num_stages=3, tma=True,
                             persistent=True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", default="4096")
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="minilm,bert-base")
    a = ap.parse_args()
    plan = []
    for model in a.models.split(","):
        d = E.HIDDEN[model]
        for M in map(int, a.M.split(",")):
            for layer, kd, nd, spec in E.LAYERS:
                for qname in ("int8", "fp8"):
                    v = E.variant(qname, spec)
                    pre = not spec["xq"]
                    cands = [dataclasses.replace(c, prequantize=pre)
                             for c in MMA + TMA + PERSISTENT_TMA]
                    plan.append((model, M, layer, kd * d, nd * d, qname, v, cands))
                    if layer == "ffn_up" and qname == "int8":  # the epilogue's share
                        for act, qout in (("none", False), ("gelu", False), ("none", True)):
                            lv = Variant(v.kind, act=act, quantized_out=qout,
                                         fast_act=act == "gelu")
                            plan.append((model, M, f"ffn_up[{act},{'q' if qout else 'bf16'}]",
                                         kd * d, nd * d, qname, lv, cands))
    precompile([(p[6], dataclasses.asdict(c)) for p in plan for c in p[7]])
    rows = []
    for p in plan:  # the file is rewritten after every row: a cut-off call keeps what ran
        rows.append(E.one_row(*p))
        if a.out:
            H.write_results(a.out, rows)
    print("\n| model | M | layer | dtype | bf16 | cuBLAS q | MMA | TMA | TMA persistent |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = {}
        for us, c in r.get("all", []):
            if isinstance(us, float):
                fam = ("tma-p" if c["persistent"] else "tma") if c["tma"] else "mma"
                best[fam] = min(best.get(fam, 1e9), us)
        q = r.get("int_mm_us") or r.get("scaled_mm_us")
        print(f"| {r['model']} | {r['M']} | {r['layer']} | {r['dtype']} | {r['bf16_us']:.1f} | "
              f"{q:.1f} | {best.get('mma', 0):.1f} | {best.get('tma', 0):.1f} | "
              f"{best.get('tma-p', 0):.1f} |")


if __name__ == "__main__":
    main()
