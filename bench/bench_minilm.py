"""End-to-end latency of the all-MiniLM-L6-v2 architecture (random weights) on the GPU.

    PYTHONPATH=. python bench/bench_minilm.py      # on a CUDA machine

The real weights (87 MB) do not travel to the GPU machine, so the model is built from the
package's config.json (bench/minilm_config.json) with random weights; accuracy is measured on
the CPU with the real weights (recipes/ptq_minilm.py), where the reference path has the same
integer semantics. qfuse and the baselines run in the same process; each is timed eagerly and
replayed as a CUDA graph (which removes Python launch cost), medians of do_bench.

The qfuse models are prepared and converted on the CPU and then moved with .to("cuda"): that
move is part of what this script checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import qfuse  # noqa: E402

BATCH, SEQ = 32, 128
# "cpu" only smoke-tests this script (tiny shapes, wall-clock timing, no CUDA graphs).
DEVICE = os.environ.get("QFUSE_BENCH_DEVICE", "cuda")
if DEVICE == "cpu":
    BATCH, SEQ = 2, 16
DYN = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}


def build(dtype):
    from transformers import BertConfig, BertModel

    config = BertConfig.from_json_file(str(Path(__file__).parent / "minilm_config.json"))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return BertModel(config, add_pooling_layer=False).eval().to(dtype)


def tokens(batch, seq, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def quantized(model, config, calib):
    prepared = qfuse.prepare(
        model,
        config,
        (),
        example_kwargs=calib[0],
        dynamic_shapes={"input_ids": DYN, "attention_mask": DYN},
    )
    with torch.no_grad():
        for batch in calib:
            prepared(**batch)
    return qfuse.convert(prepared).to(DEVICE)


def bench(fn) -> float:
    """Median microseconds."""
    if DEVICE == "cpu":
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return sorted(times)[2]
    return do_bench(fn, return_mode="median") * 1e3


def graphed(fn):
    """A CUDA-graph replay of ``fn`` (static inputs), or None if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.no_grad()
def main() -> None:
    batch = tokens(BATCH, SEQ, DEVICE)
    calib = [tokens(8, SEQ, "cpu") for _ in range(4)]
    ref_model = build(torch.float32).to(DEVICE)
    ref = ref_model(**batch).last_hidden_state.double()
    impls = {
        "fp32_eager": (ref_model, "fp32"),
        "bf16_eager": (build(torch.bfloat16).to(DEVICE), "bf16"),
        "qfuse_int8_static": (
            quantized(
                build(torch.bfloat16),
                qfuse.QConfig(symmetric=False),
                [{k: v for k, v in c.items()} for c in calib],
            ),
            "int8",
        ),
        "qfuse_fp8_static": (
            quantized(build(torch.bfloat16), qfuse.QConfig.fp8_static(), calib),
            "fp8",
        ),
    }
    rows = []
    for name, (model, dtype) in impls.items():
        out = model(**batch)
        hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
        err = harness.rel_err(hidden.float(), ref)
        fn = lambda model=model: model(**batch)  # noqa: E731
        eager = bench(fn)
        try:
            graph_us = bench(graphed(fn)) if DEVICE == "cuda" else None
        except Exception as exc:  # a capture failure is reported, not hidden
            graph_us, err_note = None, f"{type(exc).__name__}: {exc}"[:200]
        else:
            err_note = ""
        rows.append(
            dict(
                workload="minilm",
                batch=BATCH,
                seq=SEQ,
                dtype=dtype,
                impl=name,
                median_us=eager,
                graph_us=graph_us,
                max_rel_err=err,
                note=err_note,
            )
        )
    base = rows[1]["median_us"]
    base_graph = rows[1]["graph_us"]
    device = harness.environment()["device"]
    print(f"\nMiniLM-L6 architecture, batch {BATCH} x seq {SEQ}, {device}")
    print(
        f"{'impl':<20}{'eager us':>10}{'graph us':>10}{'vs bf16':>9}{'graph vs bf16':>15}"
        f"{'rel err':>9}"
    )
    for r in rows:
        g = r["graph_us"] or float("nan")
        graph_ratio = base_graph / g if base_graph else float("nan")
        print(
            f"{r['impl']:<20}{r['median_us']:>10.1f}{g:>10.1f}{base / r['median_us']:>8.2f}x"
            f"{graph_ratio:>14.2f}x{r['max_rel_err']:>9.3f}  {r['note']}"
        )
    out = dict(harness.environment(), rows=rows)
    name = "minilm_h200.json" if DEVICE == "cuda" else "minilm_cpu_smoke.json"
    path = Path(os.environ.get("QFUSE_RESULTS", Path(__file__).parent / "results")) / name
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
