"""The zoo table: every small random-weight transformers architecture in tests/zoo_models.py
through prepare → calibrate → convert → run → save/load, per config, on one device.

    python -m bench.models.zoo [cpu|cuda] [model ...] [--out F] [--budget-s S]
    # bench/results/zoo_<device>.json, rewritten after every row

Columns: GEMMs quantized / total (the rest with the summary's reason), relative error of the
converted graph and of the swapped model against float, the lowest per-layer SQNR (each
quantized layer on the float model's own input), and whether the saved file reloads bit-equal.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch
import transformers

import qfuse
from bench.harness import RESULTS, environment
from tests.zoo_models import CNNS, ZOO, run

# label -> (config, prepare kwargs). "int8 static" is the symmetric preset; asymmetric
# activations spend no level on the empty side of one-sided inputs (GELU/ReLU outputs); GPTQ
# rounds the weights, half of fp8's per-layer noise.
CONFIGS = {
    "int8 static": (qfuse.QConfig.int8_static, {}),
    "int8 static asym": (qfuse.QConfig.int8_static_asymmetric, {}),
    "int8 dynamic": (qfuse.QConfig.int8_dynamic, {}),
    "fp8 static": (qfuse.QConfig.fp8_static, {}),
    "fp8 static + GPTQ": (qfuse.QConfig.fp8_static, {"gptq": qfuse.GPTQ()}),
}


def rows(
    device: str,
    names: list[str],
    results: Path,
    meta: dict,
    budget_s: float | None = None,
    labels: list[str] | None = None,
) -> list[dict]:
    out, start = [], time.perf_counter()
    for name in names:
        for label in labels or list(CONFIGS):
            make_config, prepare_kwargs = CONFIGS[label]
            if label == "int8 dynamic" and name in CNNS | {"vit", "whisper_encoder", "wav2vec2"}:
                continue  # convolutions are static-only (a clear UnsupportedError otherwise)
            if budget_s is not None and time.perf_counter() - start > budget_s:
                print(f"budget of {budget_s:.0f} s spent: stopping before {name} {label}")
                return out
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row = run(name, make_config(), device=device, prepare_kwargs=prepare_kwargs)
            except Exception as exc:  # noqa: BLE001 - a row records the failure, the table goes on
                row = {"model": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            row["config"] = label
            out.append(row)
            print(format_row(row), flush=True)
            # written after every row: a run cut short by a time limit keeps what it measured
            results.write_text(json.dumps({**meta, "rows": out}, indent=1))
    return out


def format_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['model']} | {r['config']} | error: {r['error']} | | | | |"
    left = "; ".join(f"{k}: {v}" for k, v in r["left_float"].items())
    return (
        f"| {r['model']} ({r['class']}) | {r['config']} | {r['quantized']}/{r['gemms']}"
        f"{' (' + left + ')' if left else ''} | {r['rel_err_graph']:.4f} | "
        f"{r['rel_err_model']:.4f} | {r['min_layer_sqnr_db']:.1f} | "
        f"{'yes' if r['reloaded_equal'] else 'NO'} |"
    )


HEADER = (
    "| model | config | GEMMs quantized | rel. err (graph) | rel. err (model) | "
    "min layer SQNR dB | reload equal |\n|---|---|---|---|---|---|---|"
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("models", nargs="*", default=list(ZOO))
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/zoo_<tag>)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting rows after")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args()
    names = args.models
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tag = "h200" if "H200" in name else args.device
    suffix = "" if names == list(ZOO) else "_" + "_".join(names)
    results = Path(args.out or RESULTS / f"zoo_{tag}{suffix}.json")
    meta = {
        **environment(),  # device, torch, triton, commit (QFUSE_COMMIT on the device machine)
        "transformers": transformers.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "calibration": "8 batches x 8 sequences/images; LM head kept float (summary says why)",
    }
    print(HEADER)
    rows(args.device, names, results, meta, args.budget_s, args.configs)
    print(f"wrote {results}")
