"""Greedy generate() on a converted Llama-architecture model (small config, random weights):
CPU reference vs the GPU, int8 static, dynamic and static KV caches, eager and torch.compile.

    PYTHONPATH=. python bench/generate_parity.py      # JSON in bench/results/

The model is prepared and converted on the CPU (output="model": LlamaForCausalLM with QLinear
layers), generates there, then moves to CUDA and generates again; the tokens must be equal.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import qfuse  # noqa: E402
from tests.zoo_models import build  # noqa: E402

NEW_TOKENS = 16


def generate(model, ids, cache: str | None) -> tuple[list, float]:
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if cache:
        kwargs["cache_implementation"] = cache
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out.tolist(), time.perf_counter() - start


def main() -> None:
    model, make_inputs, _ = build("llama")
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=make_inputs())
    for i in range(8):
        prepared(**make_inputs(seed=1 + i))
    qmodel = qfuse.convert(prepared, output="model")
    ids = make_inputs(batch=4, seq=8, seed=7)["input_ids"]
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    cpu = {c: generate(qmodel, ids, c) for c in (None, "static")}
    results["float_cpu"] = generate(model, ids, None)[0]
    rows = []
    for cache, (tokens, secs) in cpu.items():
        rows.append(("cpu", cache or "dynamic", "eager", tokens, secs))
    if torch.cuda.is_available():
        gpu = copy.deepcopy(qmodel).to("cuda")
        gids = ids.cuda()
        for cache in (None, "static"):
            tokens, secs = generate(gpu, gids, cache)
            rows.append(("cuda", cache or "dynamic", "eager", tokens, secs))
        gpu.forward = torch.compile(gpu.forward)
        tokens, secs = generate(gpu, gids, "static")
        rows.append(("cuda", "static", "torch.compile", tokens, secs))
    reference = cpu[None][0]
    results["rows"] = [
        dict(device=d, cache=c, mode=m, tokens_equal_cpu=t == reference, seconds=s, tokens=t)
        for d, c, m, t, s in rows
    ]
    results["int8_equals_float_tokens"] = reference == results["float_cpu"]
    print("| device | cache | mode | tokens == CPU int8 | seconds |\n|---|---|---|---|---|")
    for r in results["rows"]:
        print(
            f"| {r['device']} | {r['cache']} | {r['mode']} | {r['tokens_equal_cpu']} | "
            f"{r['seconds']:.2f} |"
        )
    tag = "h200" if "H200" in results["device"] else "cpu"
    path = ROOT / "bench" / "results" / f"generate_parity_{tag}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    assert all(r["tokens_equal_cpu"] for r in results["rows"]), "GPU tokens differ from CPU"


if __name__ == "__main__":
    main()
