"""onnxruntime on CPU: the float model against qfuse's ONNX QDQ export, qfuse's reference beside.

    OMP_NUM_THREADS=1 python -m bench.models.bench_onnx            # -> bench/results/onnx_cpu.json

Models: all-MiniLM-L6-v2 (real weights) on a batch of 32 x 128 tokens, and the digits CNN
(recipes/ptq_digits.py, 40 epochs) on a batch of 256 images; both static int8 (symmetric
MinMax). Rows, one process, one thread each (torch and onnxruntime):
- ``ort_fp32``: the float model exported by the same ``torch.onnx.export`` (dynamo), all of
  onnxruntime's graph optimizations;
- ``ort_qdq``: ``qfuse.export_onnx`` of the converted model, onnxruntime with
  ``session.x64quantprecision`` (exact int8 sums on CPUs without AVX-VNNI; see
  ``qfuse.export.onnx.session_options``);
- ``ort_qdq_fast``: the same file in onnxruntime's default int8 mode (saturating uint8 x int8
  pairs on AVX2: faster, and off by the error shown);
- ``qfuse_cpu``: the converted model in torch (qfuse's reference kernels: the oracle, not a
  fast path); ``torch_fp32``: the float model in torch eager.
The variants run interleaved (one call of each in turn, ``--repeats`` rounds) and each reports
its median, so a load change on this shared machine hits every row alike; ``uptime`` before and
after goes in the file. ``error``: max |out - qfuse| / max |qfuse| (MiniLM: non-padded tokens).
``profile``: onnxruntime's per-op-type time for one profiled call of the fp32 and QDQ sessions.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import torch

import qfuse
from bench.harness import write_results
from qfuse.export.onnx import optimized_ops, session_options

INT8_KERNELS = ("MatMulIntegerToFloat", "QGemm", "QLinearConv", "QLinearMatMul", "MatMulInteger")


def cpu_info() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(re.findall(r"^([^:]+):\s*(.*)$", text, flags=re.M))
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
    return {
        "model": fields.get("Model name", platform.processor()),
        "cpus": os.cpu_count(),
        "flags": {f: f in flags for f in wanted},
    }


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def export_float(model, path, args=(), kwargs=None) -> None:
    dynamic = None
    if kwargs:
        dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
        dynamic = {k: dims for k in kwargs}
    else:
        dynamic = ({0: torch.export.Dim.AUTO},)
    torch.onnx.export(model, args, path, kwargs=kwargs, dynamo=True, dynamic_shapes=dynamic,
                      opset_version=19, external_data=False)


def ort_session(path, precise: bool):
    opts = session_options(precise=precise, threads=1)
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def ort_profile(path, precise: bool, feeds, calls: int = 3) -> dict:
    """Milliseconds per call by ONNX op type, from onnxruntime's profiler (``calls`` calls)."""
    opts = session_options(precise=precise, threads=1)
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        opts.profile_file_prefix = os.path.join(tmp, "ort")
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        sess.run(None, feeds)  # the first run allocates; profile the steady state
        for _ in range(calls):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    by_op: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1000.0 / (calls + 1)
    return dict(sorted(((k, round(v, 3)) for k, v in by_op.items()), key=lambda kv: -kv[1]))


def interleaved_ms(variants: dict, repeats: int) -> dict:
    """Median ms per variant, calling each in turn ``repeats`` times (after one warm-up call)."""
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def rel(out, ref, mask=None) -> float:
    out, ref = torch.as_tensor(out), torch.as_tensor(ref)
    if mask is not None:
        out, ref = out[mask], ref[mask]
    return float((out - ref).abs().max() / ref.abs().max())


def bench_model(name, float_model, qmodel, feeds_torch, reference_out, tmp, repeats, mask=None):
    """Rows for one model: export both, check every variant against qfuse, time them."""
    args = () if isinstance(feeds_torch, dict) else (feeds_torch,)
    kwargs = feeds_torch if isinstance(feeds_torch, dict) else None
    fp32_path, qdq_path = os.path.join(tmp, f"{name}_fp32.onnx"), os.path.join(tmp, f"{name}.onnx")
    export_float(float_model, fp32_path, args, kwargs)
    result = qfuse.export_onnx(qmodel, qdq_path, args, example_kwargs=kwargs)
    sessions = {"ort_fp32": ort_session(fp32_path, False), "ort_qdq": ort_session(qdq_path, True),
                "ort_qdq_fast": ort_session(qdq_path, False)}
    names = {k: s.get_inputs()[0].name for k, s in sessions.items()}
    feeds = ({k: v.numpy() for k, v in feeds_torch.items()} if kwargs
             else {names["ort_qdq"]: feeds_torch.numpy()})
    with torch.no_grad():
        ref = reference_out(qmodel(*args, **(kwargs or {})))
        fp32_ref = reference_out(float_model(*args, **(kwargs or {})))
    errors = {k: rel(s.run(None, feeds)[0], ref, mask) for k, s in sessions.items()}
    variants = {k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()}

    def torch_call(model):
        def call():
            with torch.no_grad():
                model(*args, **(kwargs or {}))
        return call

    variants["qfuse_cpu"] = torch_call(qmodel)
    variants["torch_fp32"] = torch_call(float_model)
    ms = interleaved_ms(variants, repeats)
    fp32_ms = ms["ort_fp32"]
    rows = []
    for k, t in ms.items():
        row = {"model": name, "variant": k, "ms": round(t, 2),
               "speedup_vs_ort_fp32": round(fp32_ms / t, 3)}
        if k in errors:
            row["error_vs_qfuse"] = errors[k]
        rows.append(row)
    ops = optimized_ops(qdq_path)
    return rows, {
        "int8_kernels": {k: ops[k] for k in INT8_KERNELS if ops[k]},
        "float_conv_matmul_left": {k: ops[k] for k in ("Conv", "FusedConv", "MatMul", "Gemm",
                                                       "FusedGemm", "FusedMatMul") if ops[k]},
        "fused_layers": len(result.layers),
        "quantization_error_fp32_vs_qfuse": rel(fp32_ref, ref, mask),
        "notes": result.notes,
        "profile_ms_per_call": {"ort_fp32": ort_profile(fp32_path, False, feeds),
                                "ort_qdq": ort_profile(qdq_path, True, feeds)},
    }


def minilm(tmp, repeats):
    from qfuse.calibration.sentences import calibration_sentences, heldout_sentences
    from qfuse.recipes.ptq_minilm import load_minilm

    bert, tok = load_minilm()

    def batch(sentences):
        t = tok(sentences, padding="max_length", truncation=True, max_length=128,
                return_tensors="pt")
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}

    calib = calibration_sentences()[:64]
    prepared = qfuse.prepare(bert, qfuse.QConfig.int8_static(), (), example_kwargs=batch(calib[:8]))
    with torch.no_grad():
        for i in range(0, len(calib), 16):
            prepared(**batch(calib[i:i + 16]))
    qmodel = qfuse.convert(prepared)
    feeds = batch(heldout_sentences()[:32])
    mask = feeds["attention_mask"].bool()
    return bench_model("minilm_32x128", bert, qmodel, feeds,
                       lambda out: out["last_hidden_state"] if isinstance(out, dict) else out[0],
                       tmp, repeats, mask)


def digits(tmp, repeats):
    from qfuse.calibration.digits import batches, load_digits_splits
    from qfuse.recipes.ptq_digits import load_or_train

    splits = load_digits_splits(seed=0)
    net = load_or_train(splits, 40, 0, use_cache=True)
    calib = splits.calibration[0]
    prepared = qfuse.prepare(net, qfuse.QConfig.int8_static(), example_inputs=(calib[:8],))
    with torch.no_grad():
        for xb in batches(calib, 64):
            prepared(xb)
    qmodel = qfuse.convert(prepared)
    x = splits.test[0][:256]
    return bench_model("digits_cnn_256", net, qmodel, x, lambda out: out, tmp, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/onnx_cpu.json")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", default="minilm,digits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = uptime()
    rows, details = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_rows, info = {"minilm": minilm, "digits": digits}[name](tmp, args.repeats)
            rows += model_rows
            details[model_rows[0]["model"]] = info
            for r in model_rows:
                print(r, flush=True)
    extra = {
        "cpu": cpu_info(),
        "threads": 1,
        "versions": {"onnx": onnx.__version__, "onnxruntime": ort.__version__,
                     "onnxscript": onnxscript.__version__},
        "load": {"before": load_before, "after": uptime()},
        "repeats": args.repeats,
        "details": details,
    }
    write_results(args.out, rows, extra)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
