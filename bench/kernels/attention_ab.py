"""Encoder attention: torch SDPA + the [B, S, H*D] copy + qfuse's quantize pass (what a converted
encoder runs without ``fusion.attention_quant``) against ``kernels.attention`` writing the
attention-output GEMM's int8 / fp8 input (or bf16) directly, by GPU time of CUDA-graph replays.

    python -m bench.kernels.attention_ab --out $OUT/attention_ab.json

Shapes: BERT-base 32x128 and 8x512 (H=12, D=64), MiniLM-L6 32x128 and 1x128 (H=12, D=32); q, k,
v are the strided views of one fused-QKV output [B, S, 3*H*D] in bf16, the mask export's
all-ones boolean [B, 1, S, S] (a converted graph's compiled and graphed forwards keep it). Every
kernel output is checked first against SDPA in float32 on the same inputs, cast to bf16 and
quantized by the reference quantizer (int8: at most one step off on at most 5% of the values);
a failing row carries ``error`` and no time. Each shape runs every candidate schedule; the best
per (head dim, sequence bucket) is printed as the ``kernels.attention.SCHEDULES`` entry to put in.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench import harness as H
from qfuse.kernels import quantize, tuning
from qfuse.kernels.attention import encoder as attention
from qfuse.kernels.attention.encoder import AttentionSchedule, pick_schedule, seq_bucket
from qfuse.ops import reference
from qfuse.ops.attention import INTERPRETED

DEVICE = "cuda"  # "cpu" (with TRITON_INTERPRET=1) only to smoke-test the script itself

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (batch, seq, heads, head dim)
    "bert_32x128": (32, 128, 12, 64),
    "bert_8x512": (8, 512, 12, 64),
    "minilm_32x128": (32, 128, 12, 32),
    "minilm_1x128": (1, 128, 12, 32),
}
CANDIDATES = [AttentionSchedule(*s) for s in (
    (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3),
    (32, 64, 4, 2),
)]
OUTS = {"int8": torch.int8, "fp8": FP8, "bf16": torch.bfloat16}


def inputs(B, S, Hn, D):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = torch.randn(B, S, 3 * Hn * D, device=DEVICE, generator=g).to(torch.bfloat16)
    q, k, v = (t.view(B, S, Hn, D).transpose(1, 2) for t in qkv.split(Hn * D, dim=-1))
    mask = torch.ones(B, 1, S, S, device=DEVICE, dtype=torch.bool)
    return q, k, v, mask


def check(out, ref, out_dtype) -> str | None:
    """None when ``out`` is ``ref`` up to the attention's float rounding, else why not."""
    if out_dtype == torch.int8:
        diff = (out.int() - ref.int()).abs()
        frac = (diff > 0).float().mean().item()
        ok = diff.max().item() <= 1 and frac <= 0.05
        return None if ok else f"int8: max diff {diff.max().item()}, {frac:.1%} differ"
    o, r = out.float(), ref.float()
    err = ((o - r).norm() / r.norm()).item()
    bound = 0.04 if out_dtype == FP8 else 0.01
    return None if err <= bound else f"{out_dtype}: rel err {err:.3g} > {bound}"


def run_shape(name, B, S, Hn, D) -> list[dict]:
    q, k, v, mask = inputs(B, S, Hn, D)
    scale = D**-0.5
    y32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, scale=scale)
    y = y32.transpose(1, 2).reshape(B, S, Hn * D).to(torch.bfloat16)
    amax = y.float().abs().max()
    inv = {torch.int8: (127.5 / amax).reshape(()), FP8: (448.0 / amax).reshape(())}
    refs = {torch.int8: reference.quantize_int8(y.float(), inv[torch.int8], 0.0),
            FP8: reference.quantize_fp8(y.float(), inv[FP8]), torch.bfloat16: y}
    base = dict(shape=name, B=B, S=S, H=Hn, D=D)
    rows = []

    def sdpa(m):
        o = F.scaled_dot_product_attention(q, k, v, m, scale=scale)
        return o.transpose(1, 2).reshape(B, S, Hn * D)  # the copy the Linear's input needs

    for label, m in (("mask", mask), ("nomask", None)):
        rows.append(dict(base, impl=f"sdpa_{label}", out="bf16",
                         us=tuning.device_time_ms(lambda m=m: sdpa(m)) * 1e3))
        for oname in ("int8", "fp8"):
            qd = OUTS[oname]

            def unfused(m=m, qd=qd):
                x = sdpa(m)
                return quantize.quantize(x.view(-1, Hn * D), qd, inv[qd], None, INTERPRETED)[0]

            rows.append(dict(base, impl=f"sdpa_{label}+quantize", out=oname,
                             us=tuning.device_time_ms(unfused) * 1e3))
    default = pick_schedule(D, S)
    for oname, od in OUTS.items():
        iv = inv.get(od)
        for sched in CANDIDATES + ([default] if default not in CANDIDATES else []):
            for label, m in (("mask", mask), ("nomask", None)):
                if label == "nomask" and sched != default:
                    continue
                row = dict(base, impl=f"qfuse_{label}", out=oname, block_m=sched.block_m,
                           block_n=sched.block_n, warps=sched.num_warps,
                           stages=sched.num_stages, default=sched == default)

                def call(s=sched, m=m, od=od, iv=iv):
                    return attention.attention(q, k, v, m, scale, iv, None, od, INTERPRETED,
                                               schedule=s)

                try:
                    why = check(call(), refs[od], od)
                    if why:
                        row["error"] = why
                    else:
                        row["us"] = tuning.device_time_ms(call) * 1e3
                except Exception as exc:  # noqa: BLE001 — e.g. out of shared memory
                    row["error"] = H.error_text(exc)
                rows.append(row)
    return rows


def summary(rows) -> list[dict]:
    """Per shape and output: the unfused time, the default and best kernel schedule (mask)."""
    out = []
    for name in SHAPES:
        for oname in OUTS:
            mine = [r for r in rows if r["shape"] == name and r["out"] == oname and "us" in r
                    and r["impl"] == "qfuse_mask"]
            if not mine:
                continue
            if oname == "bf16":
                base = next(r for r in rows if r["shape"] == name and r["impl"] == "sdpa_mask")
            else:
                base = next(r for r in rows if r["shape"] == name and r["out"] == oname
                            and r["impl"] == "sdpa_mask+quantize")
            best = min(mine, key=lambda r: r["us"])
            dflt = next((r for r in mine if r["default"]), None)
            out.append(dict(shape=name, out=oname, unfused_us=base["us"], best_us=best["us"],
                            default_us=dflt["us"] if dflt else None,
                            best=(best["block_m"], best["block_n"], best["warps"],
                                  best["stages"]),
                            speedup=base["us"] / best["us"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    a = ap.parse_args()
    unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {list(SHAPES)}")
    rows = []
    for name in a.shapes.split(","):
        rows += run_shape(name, *SHAPES[name])
        print(f"{name}: {sum('us' in r for r in rows)} rows timed", flush=True)
        if a.out:
            H.write_results(a.out, rows)
    table = summary(rows)
    if a.out:
        H.write_results(a.out, rows, {"summary": table})
    winners = {}
    for r in table:  # the int8 output decides the table (the quantized path is what ships)
        _, S, _, D = SHAPES[r["shape"]]
        if r["out"] == "int8":
            winners[(D, seq_bucket(S))] = r["best"]
    print("\nSCHEDULES entries (int8 winners):")
    for key, sched in sorted(winners.items()):
        print(f"    {key}: AttentionSchedule{sched},")
    print(f"\n{'shape':>15} {'out':>5} {'unfused us':>11} {'default us':>11} {'best us':>8} "
          f"{'best (BM,BN,w,s)':>18} {'x':>6}")
    for r in table:
        dflt = f"{r['default_us']:.1f}" if r["default_us"] is not None else "-"
        print(f"{r['shape']:>15} {r['out']:>5} {r['unfused_us']:11.1f} {dflt:>11} "
              f"{r['best_us']:8.1f} {str(r['best']):>18} {r['speedup']:6.2f}")


if __name__ == "__main__":
    main()
