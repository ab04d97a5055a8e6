"""The GEMMs of a TinyLlama-shape decode step one by one, as the converted model runs them, with
a cold L2 (weights stream from HBM, as they do in a 22-layer step), against cuBLAS bf16.

    PYTHONPATH=. python bench/decode_gemms.py [--out bench/results/decode_gemms_h200.json]

Per layer (Q, K/V, O, gate/up with the SwiGLU epilogue writing int8/fp8 for down, down reading
it, LM head) and M (decode batch 1, 8, 32): ``F.linear`` bf16 and every schedule of a wide
weight-streaming list (``WIDE``: tile widths, K depths, split-K) plus autotune's own candidates,
each timed by ``tuning.device_time_ms(cold=True)`` and checked against the CPU reference first.
The table at the end is the sum over one decoder layer x 22 + LM head: the GEMM part of a
decode step, which bench_llm.py's profile measures whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import harness as H  # noqa: E402
from encoder_gemms import reference_out  # noqa: E402
from warm import Variant, make_args, precompile  # noqa: E402

from qfuse.kernels import qgemm, tuning  # noqa: E402

D, FF, KV, VOCAB, LAYERS = 2048, 5632, 256, 32000, 22
# (layer, K, N, count per step, variant spec): the converted model's epilogues
GEMMS = (
    ("q", D, D, LAYERS, dict(xq=False, act="none", quantized_out=False)),
    ("k_v", D, KV, 2 * LAYERS, dict(xq=False, act="none", quantized_out=False)),
    ("o", D, D, LAYERS, dict(xq=False, act="none", quantized_out=False)),
    ("gate_up", D, 2 * FF, LAYERS, dict(xq=False, act="swiglu", quantized_out=True)),
    ("down", FF, D, LAYERS, dict(xq=True, act="none", quantized_out=False)),
    ("lm_head", D, VOCAB, 1, dict(xq=False, act="none", quantized_out=False)),
)


def wide(M: int, N: int, K: int) -> list[tuning.GemmConfig]:
    """Weight-streaming schedules: 16/32-row tiles, 32..128 columns, K blocks 128..512, split-K
    1..8 (every split leaving each program >= 2 K blocks)."""
    bm = 16 if M <= 16 else 32
    out = []
    for bn, bk, stages in ((32, 256, 4), (32, 512, 3), (64, 256, 4), (64, 512, 3),
                           (128, 256, 3), (128, 128, 5), (64, 128, 6)):
        for split in (1, 2, 4, 8):
            if split == 1 or -(-K // bk) // split >= 2:
                out.append(tuning.GemmConfig(bm, bn, bk, split_k=split, num_stages=stages))
    return out


def variant(qname: str, spec: dict) -> Variant:
    return Variant(f"{qname}-{'xq' if spec['xq'] else 'xf'}", act=spec["act"],
                   quantized_out=spec["quantized_out"], fast_act=spec["act"] == "swiglu")


def cold_us(fn) -> float:
    return tuning.device_time_ms(fn, cold=True) * 1e3


def one_row(M, layer, K, N, count, qname, v, cands, auto) -> dict:
    torch.manual_seed(0)
    args = make_args(v, M, K, N)
    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    row = dict(M=M, layer=layer, K=K, N=N, count=count, dtype=qname, kind=v.kind,
               bf16_us=cold_us(lambda: F.linear(xb, wb)),
               bf16_hot_us=tuning.device_time_ms(lambda: F.linear(xb, wb)) * 1e3)
    ref = reference_out(args)
    timed = []
    for cfg in cands:
        try:
            out = qgemm.qlinear(**args, config=cfg, fast_act=v.fast_act)
            err = H.rel_err(out.float(), ref.float().double())
            if not err <= 0.02:
                timed.append((float("inf"), cfg, f"wrong: rel err {err:.3g}"))
                continue
            us = cold_us(lambda c=cfg: qgemm.qlinear(**args, config=c, fast_act=v.fast_act))
            timed.append((us, cfg, None))
        except Exception as exc:  # noqa: BLE001 — a schedule that cannot launch
            timed.append((float("inf"), cfg, H.error_text(exc)))
    ok = sorted((t for t in timed if t[2] is None), key=lambda t: t[0])
    if not ok:
        return row | {"error": timed[0][2], "best_us": float("nan")}
    best_us, best, _ = ok[0]
    in_auto = [t for t in ok if t[1] in auto]
    row.update(best_us=best_us, best=dataclasses.asdict(best),
               autotune_best_us=in_auto[0][0] if in_auto else None,
               gb_s=N * K * (1 if qname != "bf16" else 2) / best_us / 1e3,
               bf16_gb_s=N * K * 2 / row["bf16_us"] / 1e3,
               top=[(round(u, 2), dataclasses.asdict(c)) for u, c, _ in ok[:5]],
               errors=[(dataclasses.asdict(c), e) for u, c, e in timed if e][:5])
    print(f"M{M:<3d} {layer:8s} K{K:<5d} N{N:<6d} {qname:4s} bf16 {row['bf16_us']:6.1f} "
          f"(hot {row['bf16_hot_us']:5.1f})  qfuse {best_us:6.1f} us "
          f"(autotune's {row['autotune_best_us'] or float('nan'):6.1f}) {row['gb_s']:5.0f} GB/s "
          f"vs bf16 {row['bf16_gb_s']:5.0f}  {best.block_m}x{best.block_n}x{best.block_k} "
          f"s{best.num_stages} split{best.split_k}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", default="1,8,32")
    ap.add_argument("--dtypes", default="int8,fp8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan, jobs = [], []
    for qname in a.dtypes.split(","):
        for M in map(int, a.M.split(",")):
            for layer, K, N, count, spec in GEMMS:
                v = variant(qname, spec)
                heavy = spec["act"] != "none"
                auto = tuning.runnable_candidates(M, N, K, v.kind, sms, heavy)
                # the wide list for int8 only (the bytes are the same in fp8); autotune's last
                cands = list(dict.fromkeys((wide(M, N, K) if qname == "int8" else []) + auto))
                plan.append((M, layer, K, N, count, qname, v, cands, auto))
                jobs += [(v, dataclasses.asdict(c)) for c in cands]
    precompile(jobs)
    rows = [one_row(*p) for p in plan]
    if a.out:
        H.write_results(a.out, rows)
    print("\n| M | dtype | bf16 µs (cold) | qfuse best µs | qfuse autotune-list µs | × bf16 |")
    print("|---|---|---|---|---|---|")
    sums: dict = {}
    for r in rows:
        k = (r["M"], r["dtype"])
        b, q, t = sums.get(k, (0.0, 0.0, 0.0))
        n = r["count"]
        sums[k] = (b + n * r["bf16_us"], q + n * r.get("best_us", float("nan")),
                   t + n * (r.get("autotune_best_us") or float("nan")))
    for (M, qname), (b, q, t) in sums.items():
        print(f"| {M} | {qname} | {b:.0f} | {q:.0f} | {t:.0f} | {b / q:.2f} |")


if __name__ == "__main__":
    main()
