"""Greedy generate() on a converted Llama-architecture model (small config, random weights):
the CPU reference against the GPU, dynamic and static KV caches, eager and torch.compile.

    python -m bench.models.generate_parity      # JSON in bench/results/

The model is prepared and converted on the CPU (``output="model"``: a ``LlamaForCausalLM`` whose
MLPs are ``QGatedMLP`` — gate/up one GEMM with the SwiGLU epilogue handing int8/fp8 to the down
projection — and whose attention projections are ``QLinear``), generates there, then moves to
CUDA and generates again. int8 with the IEEE-exact epilogue (``exact_epilogue=True``) is the
bit-exact contract, so its tokens must equal the CPU's; the default fast SiLU (hardware exp, an
int8 value one step off on < 1% of elements) and fp8 are reported, not required to match.
``tests/test_generate.py`` runs ``parity`` on the CPU and, marked ``gpu``, on the device.
"""

from __future__ import annotations

import copy
import json
import time

import torch

import qfuse
from bench import harness
from qfuse.nn.gated_mlp import QGatedMLP
from tests.zoo_models import build

NEW_TOKENS = 16
CACHES = ("dynamic", "static")


def quantized_llama(config: str = "int8_static"):
    """(float model, converted model of its own class, prompt ids [4, 8]) on the CPU."""
    model, make_inputs, _ = build("llama")
    model.eval()
    batches = [make_inputs(seed=1 + i) for i in range(8)]
    qmodel = harness.calibrated(model, getattr(qfuse.QConfig, config)(), batches,
                                example=make_inputs(), output="model")
    return model, qmodel, make_inputs(batch=4, seq=8, seed=7)["input_ids"]


def generate(model, ids, cache: str, new_tokens: int = NEW_TOKENS,
             auto_compile: bool = False) -> tuple[list, float]:
    """Greedy tokens and seconds. transformers compiles the decode step itself (inductor,
    ``mode="reduce-overhead"``: CUDA graphs) when the cache is static and the model is on a GPU;
    ``auto_compile=False`` turns that off (``disable_compile``) so eager rows are eager."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  disable_compile=not auto_compile)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out.tolist(), time.perf_counter() - start


def set_exact(model, exact: bool) -> None:
    for module in model.modules():
        if hasattr(module, "exact_epilogue"):
            module.exact_epilogue = exact


def parity(qmodel, ids, device: str, compile_backend: str | None = "inductor",
           new_tokens: int = NEW_TOKENS) -> tuple[list, list[dict]]:
    """The CPU's greedy tokens (dynamic cache: the reference) and rows of ``device`` ∈ {cpu,
    cuda}: each cache eager; on CUDA the static cache under transformers' own compile of the
    decode step (reduce-overhead); then the static cache with ``model.forward`` under
    ``torch.compile(backend=compile_backend)`` (None: no such row). Each row says whether its
    tokens equal the reference. ``qmodel`` is left untouched (``device`` runs a copy)."""
    reference, _ = generate(qmodel, ids, "dynamic", new_tokens)
    model = copy.deepcopy(qmodel).to(device)
    dids = ids.to(device)
    runs = [(cache, "eager") for cache in CACHES]
    if device == "cuda":
        runs.append(("static", "generate's auto-compile"))
    if compile_backend:
        runs.append(("static", f"torch.compile({compile_backend})"))
    rows = []
    for cache, mode in runs:
        if mode.startswith("torch.compile"):
            torch._dynamo.reset()
            model.forward = torch.compile(model.forward, backend=compile_backend)
        tokens, secs = generate(model, dids, cache, new_tokens, mode.startswith("generate"))
        rows.append(dict(device=device, cache=cache, mode=mode, tokens_equal_cpu=tokens ==
                         reference, seconds=round(secs, 3), tokens=tokens))
    return reference, rows


def main() -> None:
    results = harness.environment()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for config, exact in (("int8_static", True), ("int8_static", False), ("int8_dynamic", True),
                          ("fp8_static", False)):
        model, qmodel, ids = quantized_llama(config)
        set_exact(qmodel, exact)
        gated = sum(isinstance(m, QGatedMLP) for m in qmodel.modules())
        # The user-compiled row once (int8 exact): each compile costs ~10-20 s of device time.
        reference, rows = parity(qmodel, ids, device, "inductor" if exact else None)
        float_tokens, _ = generate(model, ids, "dynamic")
        runs.append(dict(config=config, exact_epilogue=exact, gated_mlps=gated,
                         cpu_tokens=reference, equals_float_tokens=reference == float_tokens,
                         rows=rows))
    results["runs"] = runs
    print("| config | epilogue | device | cache | mode | tokens == CPU | s |\n" + "|---" * 7 + "|")
    for run in runs:
        for r in run["rows"]:
            print(f"| {run['config']} | {'exact' if run['exact_epilogue'] else 'fast'} | "
                  f"{r['device']} | {r['cache']} | {r['mode']} | {r['tokens_equal_cpu']} | "
                  f"{r['seconds']:.2f} |")
    tag = "h200" if "H200" in results["device"] else "cpu"
    path = harness.RESULTS / f"generate_parity_{tag}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    exact = [r for run in runs if run["exact_epilogue"] for r in run["rows"]]
    if not all(r["tokens_equal_cpu"] for r in exact):
        raise SystemExit("int8 (exact epilogue) tokens differ from the CPU's")


if __name__ == "__main__":
    main()
