"""The zoo table: every small random-weight transformers architecture in tests/zoo_models.py
through prepare → calibrate → convert → run → save/load, per config, on one device.

    PYTHONPATH=. python bench/zoo.py [cpu|cuda] [model ...]   # bench/results/zoo_<device>.json

Columns: GEMMs quantized / total (the rest with the summary's reason), relative error of the
converted graph and of the swapped model against float, the lowest per-layer SQNR (each
quantized layer on the float model's own input), and whether the saved file reloads bit-equal.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import qfuse  # noqa: E402
from tests.zoo_models import CNNS, ZOO, run  # noqa: E402

CONFIGS = {
    "int8 static": qfuse.QConfig.int8_static,
    "int8 dynamic": qfuse.QConfig.int8_dynamic,
    "fp8 static": qfuse.QConfig.fp8_static,
}


def rows(device: str, names: list[str], results: Path, device_name: str) -> list[dict]:
    out = []
    for name in names:
        for label, make_config in CONFIGS.items():
            if label == "int8 dynamic" and name in CNNS | {"vit", "whisper_encoder", "wav2vec2"}:
                continue  # convolutions are static-only (a clear UnsupportedError otherwise)
            if label == "fp8 static" and device == "cpu" and name in CNNS:
                continue  # the fp8 conv reference is slow on CPU; measured on the GPU
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row = run(name, make_config(), calib_batches=8, device=device)
            except Exception as exc:  # noqa: BLE001 - a row records the failure, the table goes on
                row = {"model": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            row["config"] = label
            out.append(row)
            print(format_row(row), flush=True)
            # written after every row: a run cut short by a time limit keeps what it measured
            results.write_text(json.dumps({"device": device_name, "rows": out}, indent=1))
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
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    names = sys.argv[2:] or list(ZOO)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    tag = "h200" if "H200" in name else device
    suffix = "" if names == list(ZOO) else "_" + "_".join(names)
    results = ROOT / "bench" / "results" / f"zoo_{tag}{suffix}.json"
    print(HEADER)
    rows(device, names, results, name)
    print(f"wrote {results}")
