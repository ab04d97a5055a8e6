"""The GEMMs of BERT-base and MiniLM one by one, as the fused model runs them, against cuBLAS.

    python -m bench.kernels.encoder_gemms [--out $OUT/encoder_gemms_m4096.json]

Whole-model profiles (bench_models.py) give the quantized GEMMs' total; this says, per shape, which
schedule wins and by how much, so the candidate list in ``kernels/schedules.py`` is set from
measurements. Each layer runs with the epilogue it has inside the converted model (``LAYERS``):
Q/K/V merged reading the LayerNorm's int8/fp8, bf16 out; the attention output projection reading
the int8/fp8 the fused attention kernel wrote (``fusion.attention_quant``; with
``--attn-out-float`` it quantizes a bf16 input itself, as before that fusion), + residual; FFN up
with GELU (fast epilogue) writing int8/fp8; FFN down + residual. Baselines in the same run:
``F.linear`` bf16 with bias, ``torch._int_mm`` (int8 in, int32 out, no epilogue) and
``torch._scaled_mm`` (fp8 per-row, bf16 out). Every time is GPU time (``tuning.device_time_ms``:
CUDA-graph replays), because an eager launch of a Triton kernel costs more host time than these
GEMMs take; every schedule's output is checked against the reference before it counts.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from bench import harness as H
from bench.warm import Variant, make_args, precompile
from qfuse.kernels import schedules, tuning
from qfuse.kernels.gemm import dispatch as qgemm
from qfuse.ops import reference

# (layer, K, N as multiples of the hidden size d) and its variant in the fused model
LAYERS = (
    ("qkv", 1, 3, dict(xq=True, act="none", residual=False, quantized_out=False)),
    ("attn_out", 1, 1, dict(xq=True, act="none", residual=True, quantized_out=False)),
    ("ffn_up", 1, 4, dict(xq=True, act="gelu", residual=False, quantized_out=True)),
    ("ffn_down", 4, 1, dict(xq=True, act="none", residual=True, quantized_out=False)),
)
HIDDEN = {"minilm": 384, "bert-base": 768}


# "int8a": int8 with zero points, what bench_models' int8 static (asymmetric) runs.
SCHEMES = ("int8", "int8a", "fp8")


def variant(scheme: str, spec: dict) -> Variant:
    qname = scheme.rstrip("a")
    return Variant(f"{qname}-{'xq' if spec['xq'] else 'xf'}", act=spec["act"],
                   residual=spec["residual"], quantized_out=spec["quantized_out"],
                   fast_act=spec["act"] == "gelu", asym=scheme == "int8a")


def bf16_layer(spec: dict):
    """The layer as the bf16 compiled model runs it: cuBLAS GEMM with bias, and Inductor's
    kernel for what follows it (GELU, or the residual add) — what qfuse's epilogue replaces."""
    def layer(x, w, b, r):
        y = F.linear(x, w, b)
        if spec["act"] == "gelu":
            y = F.gelu(y)
        return y + r if spec["residual"] else y
    return torch.compile(layer, fullgraph=True)


def ms_us(fn) -> float:
    return tuning.device_time_ms(fn) * 1e3


def reference_out(args: dict) -> torch.Tensor:
    return reference.qlinear(**H.to_device(args, "cpu")).to(args["x"].device)


def one_row(model, M, layer, K, N, scheme, v, cands, spec) -> dict:
    """Baselines and every schedule of one layer; the row with the fastest correct one."""
    torch.manual_seed(0)
    args = make_args(v, M, K, N)
    qname = scheme.rstrip("a")
    xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    bb = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    rb = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    compiled = bf16_layer(spec)
    row = dict(model=model, M=M, layer=layer, K=K, N=N, dtype=scheme, kind=v.kind,
               act=v.act, residual=v.residual, quantized_out=v.quantized_out, asym=v.asym,
               bf16_us=ms_us(lambda: F.linear(xb, wb, bb)),
               bf16_layer_us=ms_us(lambda: compiled(xb, wb, bb, rb)))
    if qname == "int8":
        xi = (xb * 20).clamp(-127, 127).to(torch.int8)
        wt = (wb * 300).clamp(-127, 127).to(torch.int8).t()
        row["int_mm_us"] = ms_us(lambda: torch._int_mm(xi, wt))
    else:
        xf = xb.to(torch.float8_e4m3fn)
        wt = wb.to(torch.float8_e4m3fn).t()
        sa = torch.ones(M, 1, device="cuda")
        sb = torch.ones(1, N, device="cuda")
        row["scaled_mm_us"] = ms_us(lambda: torch._scaled_mm(
            xf, wt, sa, sb, out_dtype=torch.bfloat16))
    # Every schedule is checked against the CPU reference of the same arguments before it is
    # timed: int8 bit-exact (exact epilogue), fast GELU and fp8 within 2% relative.
    ref = reference_out(args) if M <= 4096 else None
    timed = []
    for cfg in cands:
        try:
            out = qgemm.qlinear(**args, config=cfg)
            if ref is not None:
                err = H.rel_err(out.float(), ref.float().double())
                if not err <= (0.02 if v.fast_act or qname == "fp8" else 1e-6):
                    timed.append((float("inf"), cfg, f"wrong: rel err {err:.3g}"))
                    continue
            us = ms_us(lambda c=cfg: qgemm.qlinear(**args, config=c))
            timed.append((us, cfg, None))
        except Exception as exc:  # noqa: BLE001 — a schedule that cannot launch
            timed.append((float("inf"), cfg, H.error_text(exc)))
    ok = [t for t in timed if t[2] is None]
    if not ok:
        print(f"{model} M{M} {layer} {qname}: no schedule ran correctly: {timed[0][2]}")
        return row | {"error": timed[0][2], "best_us": float("nan")}
    best_us, best, _ = min(ok, key=lambda t: t[0])
    row.update(best_us=best_us, best=dataclasses.asdict(best),
               tops=2 * M * N * K / best_us / 1e6,
               all=[(round(u, 2) if u != float("inf") else e, dataclasses.asdict(c))
                    for u, c, e in timed])
    base = row.get("int_mm_us") or row.get("scaled_mm_us")
    print(f"{model:9s} M{M:<6d} {layer:9s} K{K:<5d} N{N:<5d} {scheme:5s} "
          f"bf16 {row['bf16_us']:7.1f} (+epi {row['bf16_layer_us']:7.1f})  cublas-q {base:7.1f}"
          f"  qfuse {best_us:7.1f} us "
          f"({row['bf16_us'] / best_us:4.2f}x bf16, {row['tops']:4.0f} TOPS) "
          f"{best.block_m}x{best.block_n}x{best.block_k} w{best.num_warps} "
          f"s{best.num_stages}{' P' if best.persistent else ''}"
          f"{' pre' if best.prequantize else ''}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", default="128,4096,16384")
    ap.add_argument("--models", default="minilm,bert-base")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--attn-out-float", action="store_true",
                    help="attention out quantizes a bf16 input (the graph without the fusion)")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = []
    plan = []
    for model in a.models.split(","):
        d = HIDDEN[model]
        for M in map(int, a.M.split(",")):
            for layer, kd, nd, spec in LAYERS:
                if layer == "attn_out" and a.attn_out_float:
                    spec = dict(spec, xq=False)
                for scheme in a.schemes.split(","):
                    v = variant(scheme, spec)
                    heavy = spec["act"] not in ("none", "relu")
                    cands = schedules.runnable_candidates(M, nd * d, kd * d, v.kind, sms, heavy)
                    plan.append((model, M, layer, kd * d, nd * d, scheme, v, cands, spec))
                    jobs += [(v, dataclasses.asdict(c)) for c in cands]
    precompile(jobs)
    rows = [one_row(*p) for p in plan]
    if a.out:
        H.write_results(a.out, rows)
    # Per model and M: the four layers' sum, the number that goes into the whole model.
    # "bf16 + epilogue": the same layers as the bf16 compiled model runs them (GELU and the
    # residual add in Inductor kernels after cuBLAS), the work qfuse's epilogues include.
    print("\n| model | M | dtype | cuBLAS bf16 µs | bf16 + epilogue µs | qfuse µs | × cuBLAS "
          "| × bf16 + epilogue | worst shape × cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|")
    sums: dict = {}
    for r in rows:
        k = (r["model"], r["M"], r["dtype"])
        b, be, q, worst = sums.get(k, (0.0, 0.0, 0.0, float("inf")))
        sums[k] = (b + r["bf16_us"], be + r["bf16_layer_us"], q + r["best_us"],
                   min(worst, r["bf16_us"] / r["best_us"]))
    for (model, M, scheme), (b, be, q, worst) in sums.items():
        print(f"| {model} | {M} | {scheme} | {b:.1f} | {be:.1f} | {q:.1f} | {b / q:.2f} | "
              f"{be / q:.2f} | {worst:.2f} |")


if __name__ == "__main__":
    main()
