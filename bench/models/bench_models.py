"""Whole transformer encoders on the GPU: qfuse against what a user would run instead.

    python -m bench.models.bench_models --models minilm-l6 --batches 1,32,128
    python -m bench.models.bench_models --models bert-base --batches 1,32,128

Models: BERT-base (transformers' ``BertConfig()`` defaults) and all-MiniLM-L6-v2
(``minilm_config.json`` beside this file), random weights, SDPA attention, seq 128.
Implementations, all in one process: fp32 eager; bf16 eager / ``torch.compile`` / graphed;
torchao 0.18 int8 dynamic and fp8 per-row (+ compile, graphed); qfuse int8 static (asymmetric)
and fp8 static, eager / compiled / graphed. qfuse models are prepared, calibrated (4 random
batches) and converted on the GPU from the bf16 model, so every op qfuse does not quantize runs
in bf16 as in the baselines.

"compile" is ``torch.compile`` (default mode); "graph" is that compiled callable captured in a
CUDA graph and replayed (what ``mode="reduce-overhead"`` does, without a second compilation).
Every row is checked against the fp32 model's ``last_hidden_state`` before it is timed (rows over
the gate carry ``error``), timed with ``do_bench`` medians, and profiled: a ``breakdown`` of GPU
microseconds per kernel class (quantized GEMM, quantize/dequantize, GEMM, attention, LayerNorm,
other elementwise) and the kernel count, so every loss can be read off where the time goes.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import qfuse
from bench import harness

SEQ = 128
GATE = {"fp32": 1e-5, "bf16": 0.05, "torchao_int8": 0.25, "torchao_fp8": 0.25,
        "qfuse_int8": 0.25, "qfuse_fp8": 0.25}

# Kernel classes by name, first match wins (Inductor names fused kernels after their ops).
CLASSES = (
    ("LayerNorm", ("layer_norm", "layernorm", "_ln_quant")),  # qfuse's LN+quantize counts here
    ("quantized GEMM", ("_qlinear_", "int_mm", "scaled_mm", "i8i8", "f8f8", "e4m3",
                        "_fp8_", "fp8_gemm", "int8_gemm")),
    ("quantize/dequantize", ("_quantize_kernel", "quant", "dequant", "amax", "to_fp8",
                             "_to_copy")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("GEMM", ("gemm", "xmma", "cutlass", "mm_", "_mm", "matmul", "sm90", "tem_fused")),
)


def classify(name: str) -> str:
    return harness.classify(name, CLASSES, "other elementwise")


def build(model: str, dtype: torch.dtype, device: str):
    from transformers import BertConfig, BertModel

    if model == "bert-base":
        config = BertConfig()
    else:
        config = BertConfig.from_json_file(str(Path(__file__).parent / "minilm_config.json"))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return BertModel(config, add_pooling_layer=False).eval().to(device=device, dtype=dtype)


def tokens(batch: int, device: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, SEQ), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def qfuse_model(model, config, device):
    calib = [tokens(8, device, seed=10 + i) for i in range(4)]
    dyn = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    return harness.calibrated(model, config, calib,
                              dynamic_shapes={"input_ids": dyn, "attention_mask": dyn})


def torchao_model(model, kind):
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
    )

    model = copy.deepcopy(model)
    cfg = (Int8DynamicActivationInt8WeightConfig() if kind == "int8"
           else Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    harness.torchao_quantize(model, cfg)  # Inductor's settings left alone (see harness)
    return model


def hidden(out) -> torch.Tensor:
    return out["last_hidden_state"] if isinstance(out, dict) else out[0]


def breakdown(fn, calls: int = 3) -> tuple[dict, int]:
    """GPU microseconds per kernel class per call, and kernels per call (torch.profiler)."""
    kernels = harness.cuda_kernels(fn, calls)
    out: dict[str, float] = {}
    for name, us in kernels:
        cls = classify(name)
        out[cls] = out.get(cls, 0.0) + us / calls
    out = {k: round(v, 1) for k, v in sorted(out.items())}
    out["total"] = round(sum(out.values()), 1)
    return out, len(kernels) // calls


def run_row(rows, model_name, batch, impl, mode, fn, ref, out_path):
    row = dict(model=model_name, batch=batch, seq=SEQ, impl=impl, mode=mode)
    t0 = time.time()
    try:
        out = hidden(fn())
        err = harness.rel_err(out.float(), ref)
        row["max_rel_err"] = err
        if not err <= GATE[impl]:
            row["error"] = f"wrong result: rel err {err:.3g} > {GATE[impl]}"
        else:
            row["median_us"] = harness.median_us(fn)
            row["breakdown"], row["launches"] = breakdown(fn)
    except Exception as exc:  # noqa: BLE001 — a failing row is a result, not a crash
        row["error"] = harness.error_text(exc)
    torch.cuda.synchronize()
    row["wall_s"] = round(time.time() - t0, 1)
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "breakdown"}), flush=True)
    harness.write_results(out_path, rows)  # keep what was measured if a later row dies


# Modes to time (``--modes``): "graph" alone still compiles (it replays the compiled callable).
MODES = ("eager", "compile", "graph")


def modes_of(impl: str) -> tuple[str, ...]:
    if impl == "fp32":
        base = ("eager",)
    elif impl.startswith("torchao"):
        base = ("compile", "graph")
    else:
        base = ("eager", "compile", "graph")
    return tuple(m for m in base if m in MODES)


def launch_modes(model) -> dict[str, int]:
    """Fused Linears per eager launch mode (``QLinear.launch_mode``: "cached launch", or the
    reason a layer takes Triton's own 50-100 µs launch)."""
    from qfuse.nn import QLinear

    modes: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QLinear):
            modes[m.launch_mode] = modes.get(m.launch_mode, 0) + 1
    return modes


def pending(done: set, model_name: str, batch: int, impl: str) -> bool:
    return any((model_name, batch, impl, m) not in done for m in modes_of(impl))


@torch.no_grad()
def bench_model(model_name, batches, impls, rows, out_path, done=frozenset(), deadline=None):
    """Every (batch, impl, mode) row of one model not in ``done``; no new (batch, impl) unit
    starts after ``deadline`` (``time.time()``), so a call's time limit leaves whole rows."""
    dev = "cuda"
    todo = {i for i in impls if any(pending(done, model_name, b, i) for b in batches)}
    if not todo:
        return
    fp32 = build(model_name, torch.float32, dev)
    bf16 = build(model_name, torch.bfloat16, dev)
    models = {}
    if "qfuse_int8" in todo:
        models["qfuse_int8"] = qfuse_model(bf16, qfuse.QConfig(symmetric=False), dev)
    if "qfuse_fp8" in todo:
        models["qfuse_fp8"] = qfuse_model(bf16, qfuse.QConfig.fp8_static(), dev)
    for kind in ("int8", "fp8"):
        if f"torchao_{kind}" in todo:
            try:
                models[f"torchao_{kind}"] = torchao_model(bf16, kind)
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(model=model_name, impl=f"torchao_{kind}", mode="eager",
                                 batch=0, seq=SEQ, error=harness.error_text(exc)))
    for batch in batches:
        if not any(pending(done, model_name, batch, i) for i in impls):
            continue
        inp = tokens(batch, dev)
        ref = hidden(fp32(**inp)).double()
        if pending(done, model_name, batch, "fp32") and "fp32" in impls:
            run_row(rows, model_name, batch, "fp32", "eager", lambda i=inp: fp32(**i), ref,
                    out_path)
        for impl in impls:
            if impl == "fp32" or not pending(done, model_name, batch, impl):
                continue
            if deadline is not None and time.time() > deadline:
                print(f"budget spent: {model_name} batch {batch} {impl} not started", flush=True)
                continue
            model = bf16 if impl == "bf16" else models.get(impl)
            if model is None:
                continue
            if "eager" in modes_of(impl) and (model_name, batch, impl, "eager") not in done:
                run_row(rows, model_name, batch, impl, "eager", lambda m=model, i=inp: m(**i), ref,
                        out_path)
                if impl.startswith("qfuse"):  # how each fused Linear launched (cached or why not)
                    rows[-1]["launch_modes"] = launch_modes(model)
                    harness.write_results(out_path, rows)
            torch._dynamo.reset()
            compiled = torch.compile(model)
            fn = lambda c=compiled, i=inp: c(**i)  # noqa: E731
            # torchao's rows compile (at their first call) with torchao's Inductor settings
            with harness.torchao_inductor() if impl.startswith("torchao") else nullcontext():
                if "compile" in modes_of(impl):
                    run_row(rows, model_name, batch, impl, "compile", fn, ref, out_path)
                else:
                    fn()  # compiled here, at its first call, not inside the graph capture
            try:
                replay = harness.graphed(fn)
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(model=model_name, batch=batch, seq=SEQ, impl=impl,
                                 mode="graph", error=harness.error_text(exc)))
                continue
            run_row(rows, model_name, batch, impl, "graph", replay, ref, out_path)


def table(rows):
    """Markdown: per model and batch, µs per impl/mode and × bf16 in the same mode."""
    base = {(r["model"], r["batch"], r["mode"]): r["median_us"] for r in rows
            if r.get("impl") == "bf16" and "median_us" in r}
    lines = ["| model | batch | impl | mode | µs | × bf16 same mode | launches | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "median_us" not in r:
            lines.append(f"| {r['model']} | {r.get('batch')} | {r['impl']} | {r.get('mode')} | "
                         f"{r.get('error', '')[:80]} | | | |")
            continue
        b = base.get((r["model"], r["batch"], r["mode"]))
        ratio = f"{b / r['median_us']:.2f}" if b else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['impl']} | {r['mode']} | "
                     f"{r['median_us']:.0f} | {ratio} | {r.get('launches', '')} | "
                     f"{r['max_rel_err']:.3g} |")
    return "\n".join(lines)


def resumed_rows(path: str) -> list[dict]:
    """The timed rows of an earlier, interrupted call at the same commit (a row measured on
    other code does not mix in: the file's ``commit`` must match ``harness.environment``'s)."""
    if not Path(path).exists():
        return []
    with open(path) as f:
        old = json.load(f)
    if old.get("commit") != harness.environment()["commit"]:
        print(f"--resume: {path} is from commit {old.get('commit')}; starting over", flush=True)
        return []
    return [r for r in old.get("rows", []) if "median_us" in r]


def main():
    global MODES, SEQ
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm-l6,bert-base")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--impls", default="fp32,bf16,torchao_int8,torchao_fp8,qfuse_int8,qfuse_fp8")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="eager,compile,graph (whole models are judged by graph)")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows --out already holds for this commit; run the rest")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new (batch, impl) after this many seconds")
    args = ap.parse_args()
    MODES = tuple(args.modes.split(","))
    SEQ = args.seq
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    out_path = args.out or str(harness.RESULTS / f"models_{gpu}.json")
    rows = resumed_rows(out_path) if args.resume else []
    done = {(r["model"], r["batch"], r["impl"], r["mode"]) for r in rows if "median_us" in r}
    deadline = time.time() + args.budget_s if args.budget_s else None
    impls = args.impls.split(",")
    for model_name in args.models.split(","):
        bench_model(model_name, harness.ints(args.batches), impls, rows, out_path, done, deadline)
    print(table(rows))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
