"""A/B of qfuse's decode-size GEMMs: the MMA kernel's schedules, the decode kernel's, cuBLAS.

    python -m bench.kernels.decode_gemm_ab --out $OUT/decode_ab.json     (GPU, < 120 s)
    python -m bench.kernels.decode_gemm_ab --tiny                         (CPU smoke test)

TinyLlama-1.1B's GEMMs (hidden 2048, intermediate 5632, 4 KV heads of 64) at M = 1, 8, 32
tokens, int8 and fp8, each with the epilogue it has in a converted decoder layer: Q/K/V (merged,
and K or V alone) and o_proj from float x, gate+up merged with the SwiGLU epilogue handing
int8/fp8 to down, down from quantized x with the residual. Per case:

- every candidate schedule ``schedules.candidates`` offers: the MMA kernel's (``_qlinear_kernel``;
  the best of them is "qfuse before", what autotune picked before the decode kernel existed)
  and the decode kernel's (``decode=True``); the best of all is "qfuse after";
- cuBLAS bf16 ``F.linear`` on the same shape, ``torch._int_mm`` / ``torch._scaled_mm`` (the
  GEMM alone, no epilogue) where they accept it.

Each variant's output is checked against ``ops.reference`` first (int8 GEMMs: int8 outputs bit
for bit, float outputs to float32 rounding; fp8: one quantization step at most, on < 2% of the
outputs), then timed by ``triton.testing.do_bench`` (median) on a CUDA graph of one call:
do_bench zeroes a 256 MB buffer before every call, so the weights come from HBM (cold L2, as in
a decode step) and the graph keeps the host's launch cost out of the kernel's time. Compiling
~300 kernel variants dominates; a spawn pool compiles them in parallel into Triton's disk cache
first. Prints each case's per-config times, then a summary table (us, GB/s of weight bytes, x
bf16).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
import zlib

if "--tiny" in sys.argv:  # before triton is imported: run the kernels in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from bench import harness as H
from qfuse.kernels.gemm.call import GemmCall

FP8 = torch.float8_e4m3fn

# name, K, N (weight rows), activation, x quantized already, quantized output, residual
SHAPES = (
    ("qkv", 2048, 2560, "none", False, False, False),
    ("k_or_v", 2048, 256, "none", False, False, False),
    ("o_proj", 2048, 2048, "none", False, False, True),
    ("gate_up", 2048, 11264, "swiglu", False, True, False),
    ("down", 5632, 2048, "none", True, False, True),
)
TINY_SHAPES = (
    ("qkv", 64, 48, "none", False, False, False),
    ("gate_up", 64, 44, "swiglu", False, True, False),
    ("down", 88, 24, "none", True, False, True),
    ("odd_k", 75, 20, "none", True, True, False),
)
MS = (1, 8, 32)
TINY_MS = (1, 3)
QDTYPES = (("int8", torch.int8), ("fp8", FP8))


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple
    M: int
    qname: str

    @property
    def name(self) -> str:
        return f"{self.shape[0]} M={self.M} {self.qname}"

    @property
    def qdtype(self) -> torch.dtype:
        return dict(QDTYPES)[self.qname]

    @property
    def kind(self) -> str:
        return f"{self.qname}-{'xq' if self.shape[4] else 'xf'}"


def make_args(case: Case, device: str) -> dict:
    """``dispatch.qlinear``'s arguments for ``case`` (``harness.call_args``: ``x``, the layer's
    ``call``, ``residual``; seeded: every process builds the same tensors). Scales put the
    outputs in the quantized range."""
    _, K, N, act, x_q, out_q, residual = case.shape
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    qdtype = case.qdtype
    x = torch.randn(case.M, K, generator=g)
    x_inv = torch.tensor(32.0)  # x in +-4 sigma on the int8 grid
    if qdtype == FP8:
        w = (torch.randn(N, K, generator=g) * 64).clamp(-448, 448).to(FP8)
        x_inv = torch.tensor(100.0)
    else:
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    from qfuse.ops import reference

    if x_q:
        x = reference._quantize_input(x, x_inv, None, qdtype)
    else:
        x = x.to(torch.bfloat16)
    # acc std ~ sqrt(K) * std(x_q) * std(w) (int8 w uniform: 73); scaled to ~1, where the
    # activations bend and the quantized outputs use their range
    acc_std = K**0.5 * x_inv.item() * (73.0 if qdtype == torch.int8 else 64.0)
    scale = (torch.rand(N, generator=g) + 0.5) / acc_std
    n_out = N // 2 if act == "swiglu" else N
    args = dict(
        x=x, weight=w, scale=scale, bias=torch.randn(N, generator=g) * 0.1,
        x_inv_scale=None if x_q else x_inv, x_zero_point=None, weight_sum=None,
        residual=torch.randn(case.M, n_out, generator=g).to(torch.bfloat16) if residual else None,
        out_inv_scale=torch.tensor(40.0 if qdtype == torch.int8 else 100.0) if out_q else None,
        out_zero_point=None, act=act, out_dtype=qdtype if out_q else torch.bfloat16,
    )
    return H.to_device(H.call_args(GemmCall, args), device)


def qfuse_configs(case: Case, sms: int) -> list:
    """Every schedule autotune would time for this case (``schedules.runnable_candidates``)."""
    from qfuse.kernels import schedules

    _, K, N, act, *_ = case.shape
    heavy = act not in ("none", "relu")
    return schedules.runnable_candidates(case.M, N, K, case.kind, sms, heavy, 2)


def cfg_name(cfg) -> str:
    tag = "decode" if cfg.decode else "mma"
    return (f"{tag} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}" + (" +quantize pass" if cfg.prequantize else ""))


def _run_qfuse(args: dict, cfg):
    from qfuse.kernels.gemm import dispatch as qgemm

    return qgemm.qlinear(**args, config=cfg)


_ARGS: dict = {}  # a worker's inputs per case: building 23 MB of weights once, not per job


def _compile_job(job):
    """Worker: run one (case, schedule) once so Triton's disk cache holds its binary."""
    case, cfg = job
    try:
        if case not in _ARGS:
            _ARGS.clear()
            _ARGS[case] = make_args(case, "cuda")
        _run_qfuse(_ARGS[case], cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 — reported; the main loop records it per variant
        return f"{case.name} {cfg_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}"


def precompile(jobs, workers: int) -> None:
    t0 = time.time()
    seen, unique = set(), []
    for case, cfg in jobs:  # one compile per (shape and epilogue, kind, schedule): M is not
        key = (case.shape, case.qname, cfg)  # specialized (do_not_specialize)
        if key not in seen:
            seen.add(key)
            unique.append((case, cfg))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        # chunks of one case's schedules: a worker builds that case's inputs once
        errors = [e for e in pool.map(_compile_job, unique, chunksize=8) if e]
    print(f"precompiled {len(unique)} variants in {time.time() - t0:.0f} s with {workers} "
          f"processes, {len(errors)} failed", flush=True)
    for e in errors[:5]:
        print("  ", e, flush=True)


# ---- checks ----

def reference_out(args: dict) -> torch.Tensor:
    from qfuse.ops import reference

    return reference.qlinear(**H.to_device(args, "cpu"))


def check(out: torch.Tensor, ref: torch.Tensor, args: dict) -> str | None:
    """None if ``out`` matches the reference as the test suite requires, else why not."""
    out = out.cpu()
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    int8_gemm = args["call"].weight.dtype == torch.int8
    if out.dtype == torch.int8 and int8_gemm:
        n = (out != ref).sum().item()
        return None if n == 0 else f"{n} int8 outputs differ"
    if out.dtype in (torch.int8, FP8):  # fp8 GEMM: one step at most, rarely
        inv = args["call"].out_inv_scale.item()
        o, r = out.double() / inv, ref.double() / inv
        step = (r.abs() * 2.0**-3).clamp_min(2.0**-9 / inv) if out.dtype == FP8 else 1.0 / inv
        diff = (o - r).abs()
        if not (diff <= step * 1.01 + 1e-12).all():
            return f"off by more than a step: max {diff.max().item():.3g}"
        frac = (diff > 0).double().mean().item()
        return None if frac < 0.02 else f"{frac:.1%} outputs one step off"
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    bound = (1e-6 if int8_gemm else 1e-4) + (4e-3 if out.dtype != torch.float32 else 0.0)
    return None if err < bound else f"relative error {err:.2e} > {bound:.0e}"


# ---- timing ----

def time_us(fn) -> float:
    """Median GPU time of one ``fn()`` (a CUDA graph of it where it captures), cold L2."""
    import triton

    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception:  # noqa: BLE001 — not capturable: time the eager call
        torch.cuda.synchronize()
        run = fn
    return triton.testing.do_bench(run, warmup=2, rep=12, return_mode="median") * 1e3


def baselines(case: Case, args: dict):
    """(name, fn, check) of the non-qfuse GEMMs: cuBLAS bf16 and the quantized torch GEMMs."""
    x, w = args["x"], args["call"].weight
    xb = x.to(torch.bfloat16) if x.dtype != FP8 else x.float().to(torch.bfloat16)
    wb = w.float().to(torch.bfloat16)
    bf16_ref = F.linear(xb.float().cpu(), wb.float().cpu())
    out = [("cuBLAS bf16 F.linear", lambda: F.linear(xb, wb), bf16_ref, 2)]
    from qfuse.ops import reference

    xq = x if not x.is_floating_point() or x.dtype == FP8 else \
        reference._quantize_input(x.float().cpu(), args["call"].x_inv_scale.cpu(), None,
                                  case.qdtype).to(x.device)
    if case.qdtype == torch.int8:
        wt = w.t()
        acc = reference.int_matmul(xq.cpu(), w.cpu())
        out.append(("torch._int_mm", lambda: torch._int_mm(xq, wt), acc, 1))
    else:
        wt = w.t()
        one = torch.ones((), device=x.device)
        acc = reference.fp8_matmul(xq.cpu(), w.cpu()).to(torch.bfloat16)
        out.append(("torch._scaled_mm", lambda: torch._scaled_mm(
            xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), acc, 1))
    return out


def float_check(out, ref) -> str | None:
    out = out.cpu()
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    if out.dtype == torch.int32:
        return None if torch.equal(out, ref) else "int32 accumulators differ"
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    return None if err < 1e-2 else f"relative error {err:.2e}"


# ---- the run ----

def run_case(case: Case, sms: int, device: str, timed: bool) -> dict:
    args = make_args(case, device)
    ref = reference_out(args)
    _, K, N, *_ = case.shape
    rows = []
    for cfg in qfuse_configs(case, sms):
        row = dict(impl="qfuse", config=dataclasses.asdict(cfg), name=cfg_name(cfg),
                   bytes=N * K)
        try:
            row["error"] = check(_run_qfuse(args, cfg), ref, args)
            if row["error"] is None and timed:
                row["us"] = time_us(lambda c=cfg: _run_qfuse(args, c))
        except Exception as exc:  # noqa: BLE001 — a schedule that cannot run is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    for name, fn, bref, width in baselines(case, args):
        row = dict(impl=name, name=name, bytes=N * K * width)
        try:
            row["error"] = float_check(fn(), bref)
            if row["error"] is None and timed:
                row["us"] = time_us(fn)
        except Exception as exc:  # noqa: BLE001 — e.g. _int_mm's M > 16 rule
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
    return dict(case=case.name, shape=case.shape[0], M=case.M, dtype=case.qname, K=K, N=N,
                rows=rows)


def best(rows, pred):
    timed = [r for r in rows if pred(r) and r.get("us") is not None]
    return min(timed, key=lambda r: r["us"]) if timed else None


def summarize(result: dict) -> dict:
    rows = result["rows"]
    picks = dict(
        bf16=best(rows, lambda r: r["impl"] == "cuBLAS bf16 F.linear"),
        before=best(rows, lambda r: r["impl"] == "qfuse" and not r["config"]["decode"]),
        decode=best(rows, lambda r: r["impl"] == "qfuse" and r["config"]["decode"]),
        torch_q=best(rows, lambda r: r["impl"] in ("torch._int_mm", "torch._scaled_mm")),
    )
    return {k: (v["name"], v["us"], v["bytes"]) if v else None for k, v in picks.items()}


def print_case(result: dict) -> None:
    print(f"-- {result['case']} (K={result['K']} N={result['N']})", flush=True)
    for r in sorted(result["rows"], key=lambda r: r.get("us") or float("inf")):
        t = f"{r['us']:8.2f} us {r['bytes'] / r['us'] / 1e3:7.0f} GB/s" if r.get("us") else \
            " " * 25
        print(f"   {t}  {r['name']}" + (f"  ERROR {r['error']}" if r.get("error") else ""))


def print_table(results: list) -> None:
    def cell(p, base):
        if p is None:
            return "-"
        _, us, nbytes = p
        x = f" {base / us:.2f}x" if base else ""
        return f"{us:.1f} us {nbytes / us / 1e3:.0f} GB/s{x}"

    print("\n| case | cuBLAS bf16 | qfuse before (best MMA) | qfuse decode kernel (best) | "
          "best decode config | torch int8/fp8 GEMM |")
    print("|---|---|---|---|---|---|")
    for res in results:
        s = summarize(res)
        base = s["bf16"][1] if s["bf16"] else None
        dec_cfg = s["decode"][0] if s["decode"] else "-"
        print(f"| {res['case']} | {cell(s['bf16'], None)} | {cell(s['before'], base)} | "
              f"{cell(s['decode'], base)} | {dec_cfg} | {cell(s['torch_q'], base)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="decode_ab.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, no timing")
    p.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    p.add_argument("--only", default="", help="comma-separated shape names")
    p.add_argument("--ms", default="", help="comma-separated token counts (default 1,8,32)")
    a = p.parse_args()
    shapes = TINY_SHAPES if a.tiny else SHAPES
    if a.only:
        shapes = tuple(s for s in shapes if s[0] in a.only.split(","))
    ms = tuple(int(m) for m in a.ms.split(",")) if a.ms else TINY_MS if a.tiny else MS
    cases = [Case(s, M, q) for s in shapes for M in ms for q, _ in QDTYPES]
    t0 = time.time()
    if a.tiny:
        device, sms = "cpu", 132
    else:
        device = "cuda"
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        if a.workers > 1:
            precompile([(c, cfg) for c in cases for cfg in qfuse_configs(c, sms)], a.workers)
    from qfuse.kernels import schedules

    schedules.INTERPRETER_CONFIG  # noqa: B018 — qfuse importable before the loop
    results = []
    for case in cases:
        res = run_case(case, sms, device, timed=not a.tiny)
        results.append(res)
        print_case(res)
    bad = [(r["case"], x["name"], x["error"]) for r in results for x in r["rows"]
           if x.get("error") and x["impl"] == "qfuse"]
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               torch=torch.__version__, seconds=round(time.time() - t0, 1),
               commit=os.environ.get("QFUSE_COMMIT", "unknown"))
    import triton

    env["triton"] = triton.__version__
    with open(a.out, "w") as f:
        json.dump(dict(environment=env, results=results), f, indent=1)
    print(f"\n{env}; {len(bad)} qfuse variants failed their check; wrote {a.out}")
    for b in bad[:10]:
        print("   FAILED", *b)
    if not a.tiny:
        print_table(results)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
