"""4-bit weights on the LLM yardstick (SmolLM2-135M-Instruct, ``calibration/smollm2/``): W4A16 and
W4A8 with group scales, round-to-nearest, GPTQ or AWQ (and AWQ + GPTQ), as a user runs them.

    python -m qfuse.recipes.ptq_llm_w4 --out reports/llm_w4.json
    python -m qfuse.recipes.ptq_llm_w4 --configs "w4a16 g128 gptq" --threads 1

Each config: ``qfuse.prepare`` on the float model, the calibration windows through it,
``qfuse.convert(output="model")`` (a ``LlamaForCausalLM`` again; the tied LM head stays float),
then perplexity on held-out windows the calibration never saw, beside float's measured the same
way, and greedy answers to the chat prompts. One JSON row per config, written as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from qfuse.calibration import smollm2  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import qfuse  # noqa: E402

Q = qfuse.QConfig
CONFIGS = {
    "w4a16 g128 rtn": (Q.w4a16(128), {}),
    "w4a16 g128 gptq": (Q.w4a16(128), {"gptq": qfuse.GPTQ()}),
    "w4a16 g128 asym gptq": (Q.w4a16(128, symmetric=False), {"gptq": qfuse.GPTQ()}),
    "w4a16 g64 gptq": (Q.w4a16(64), {"gptq": qfuse.GPTQ()}),
    # SmolLM2's GGUF is Q4_1: its Linear weights are already 4-bit (asymmetric) in blocks of 32
    # columns, so groups of 32 re-round on nearly the same grid
    "w4a16 g32 asym rtn": (Q.w4a16(32, symmetric=False), {}),
    "w4a16 g32 rtn": (Q.w4a16(32), {}),
    "w4a16 g64 asym gptq": (Q.w4a16(64, symmetric=False), {"gptq": qfuse.GPTQ()}),
    "w4a8 g128 gptq": (Q.w4a8(128), {"gptq": qfuse.GPTQ()}),
    "w4a8 g128 asym gptq": (Q.w4a8(128, symmetric=False), {"gptq": qfuse.GPTQ()}),
    "w4a8 g128 rtn": (Q.w4a8(128), {}),
    # AWQ (#36): per-input scales folded into the RMSNorms (Q/K/V, gate/up) and per-group
    # weight clips, searched on the calibration rows; then round-to-nearest or GPTQ
    "w4a16 g128 asym rtn": (Q.w4a16(128, symmetric=False), {}),
    "w4a16 g128 asym awq": (Q.w4a16(128, symmetric=False), {"awq": qfuse.AWQ()}),
    "w4a16 g128 asym awq noclip": (Q.w4a16(128, symmetric=False), {"awq": qfuse.AWQ(clip=False)}),
    "w4a16 g128 asym awq + gptq": (Q.w4a16(128, symmetric=False),
                                   {"awq": qfuse.AWQ(), "gptq": qfuse.GPTQ()}),
    "w4a16 g128 asym awq noclip + gptq": (Q.w4a16(128, symmetric=False),
                                          {"awq": qfuse.AWQ(clip=False), "gptq": qfuse.GPTQ()}),
    "w4a16 g64 asym awq + gptq": (Q.w4a16(64, symmetric=False),
                                  {"awq": qfuse.AWQ(), "gptq": qfuse.GPTQ()}),
    "w4a8 g128 asym awq + gptq": (Q.w4a8(128, symmetric=False),
                                  {"awq": qfuse.AWQ(), "gptq": qfuse.GPTQ()}),
}


def run(name: str, model, calib, held, float_ppl: float, chat: bool) -> dict:
    config, kwargs = CONFIGS[name]
    row: dict = {"config": name, "qconfig": config.to_dict()}
    t = time.perf_counter()
    prepared = qfuse.prepare(model, config, (), example_kwargs={"input_ids": calib[:2, :-1]},
                             **kwargs)
    needs_data = not config.weight_only or kwargs  # W4A16 round-to-nearest reads no data
    with torch.no_grad():
        for i in tqdm(range(0, calib.shape[0], 4) if needs_data else (), desc="calibration",
                      total=-(-len(calib) // 4) if needs_data else 0):
            prepared(input_ids=calib[i:i + 4, :-1])
    row["calibrate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    qmodel = qfuse.convert(prepared, output="model")
    row["convert_s"] = time.perf_counter() - t
    precisions: dict[str, int] = {}
    for r in qfuse.summary(qmodel).rows:
        precisions[r["precision"]] = precisions.get(r["precision"], 0) + 1
    row["precisions"] = precisions
    t = time.perf_counter()
    row["ppl"], _ = smollm2.score(qmodel, held)
    row["eval_s"] = time.perf_counter() - t
    row["change_pct"] = 100 * (row["ppl"] / float_ppl - 1)
    if chat:
        row["chat"] = smollm2.chat(qmodel)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="w4a16 g128 rtn,w4a16 g128 gptq,w4a16 g128 asym gptq,"
                    "w4a8 g128 asym gptq",
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--out", default="reports/llm_w4.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-chat", action="store_true")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    torch.set_num_threads(args.threads)
    model = smollm2.load_model()
    calib, held = smollm2.calibration_windows(), smollm2.heldout_windows()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    float_ppl, _ = smollm2.score(model, held)
    rows = [{"config": "float", "ppl": float_ppl, "eval_s": time.perf_counter() - t}]
    if not args.no_chat:
        rows[0]["chat"] = smollm2.chat(model)
    print(json.dumps(rows[0]), flush=True)
    for name in names:
        rows.append(run(name, model, calib, held, float_ppl, not args.no_chat))
        print(json.dumps(rows[-1]), flush=True)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
