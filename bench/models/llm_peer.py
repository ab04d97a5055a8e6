"""llm-compressor's W8A8 (SmoothQuant + GPTQ) and FP8_DYNAMIC on the LLM yardstick (SmolLM2,
``calibration/smollm2/``; ``--model toy``: the small Llama of ``calibration/llm/``): the peer
rows of ``qfuse.recipes.ptq_llm``, measured with the same data and metric code.

    /work/venv-llmc/bin/python -m bench.models.llm_peer --out /tmp/peer.json   # from the repo root
    python -m qfuse.recipes.ptq_llm --peer /work/venv-llmc/bin/python      # runs this for you

The data module is loaded from its file (it imports only torch and transformers), so the peer's
venv needs no qfuse.

llm-compressor 0.14 pins compressed-tensors 0.19 and transformers <= 5.17, which clash with
qfuse's environment, so it runs in a venv of its own (README, "A trained LLM"):

    python3 -m venv /work/venv-llmc
    /work/venv-llmc/bin/pip install "llmcompressor==0.14.*" "torch==2.13.0" gguf accelerate

Recipe: its documented W8A8 example (``examples/quantization_w8a8_int8``):
``SmoothQuantModifier(smoothing_strength=alpha)`` then ``GPTQModifier(targets="Linear",
scheme="W8A8", ignore=["lm_head"])`` through ``oneshot`` on the calibration windows qfuse
calibrates on. W8A8 is int8 per-channel symmetric weights and int8 per-token dynamic
activations. The model is then evaluated as ``oneshot`` leaves it in memory: compressed-tensors'
quantized forward, which fake-quantizes (quantize then dequantize, in float on the CPU) each
targeted Linear's input per token and its weight per channel.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[2]


def dataset(name: str):
    """``calibration/<smollm2|llm>/__init__.py`` as a module of its own (no qfuse import)."""
    folder = {"smollm2": "smollm2", "toy": "llm"}[name]
    spec = importlib.util.spec_from_file_location(
        f"peer_data_{folder}", ROOT / "calibration" / folder / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize(model, calib: torch.Tensor, alpha: float, scheme: str, tokenizer):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    inputs = calib[:, :-1]
    ds = Dataset.from_dict(
        {"input_ids": inputs.tolist(), "attention_mask": torch.ones_like(inputs).tolist()}
    )
    if scheme == "fp8_dynamic":
        recipe = [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    else:
        recipe = [
            SmoothQuantModifier(smoothing_strength=alpha),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        ]
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=inputs.shape[1],
        num_calibration_samples=inputs.shape[0],
        processor=tokenizer,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calibration", type=int, default=None, help="calibration windows")
    parser.add_argument("--heldout", type=int, default=None, help="held-out windows")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant strength")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=("smollm2", "toy"), default="smollm2")
    parser.add_argument("--scheme", choices=("w8a8", "fp8_dynamic"), default="w8a8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import llmcompressor

    data = dataset(args.model)
    model = data.load_model()
    held, valid = data.heldout_windows(args.heldout), data.validation_windows()
    ref_ppl, ref_greedy = data.score(model, held)
    prompts = data.prompts(held, args.prompts)
    ref_generated = data.generate(model, prompts)
    t0 = time.perf_counter()
    quantize(model, data.calibration_windows(args.calibration), args.alpha, args.scheme,
             data.load_tokenizer())
    seconds = time.perf_counter() - t0
    ppl, greedy = data.score(model, held)
    what = ("FP8_DYNAMIC" if args.scheme == "fp8_dynamic"
            else f"W8A8, SmoothQuant {args.alpha} + GPTQ")
    row = dict(
        config=f"llm-compressor {llmcompressor.__version__} {what}",
        perplexity=ppl,
        validation_perplexity=data.score(model, valid)[0],
        top1_agreement=(greedy == ref_greedy).float().mean().item(),
        generation_agreement=(data.generate(model, prompts) == ref_generated).float().mean().item(),
        **({"chat": data.chat(model)} if hasattr(data, "chat") else {"sample": data.sample(model)}),
        float_perplexity_here=ref_ppl,
        convert_seconds=seconds,
        evaluated_as="fake-quant in float on the CPU (compressed-tensors' quantized forward)",
        versions={
            m: __import__(m).__version__
            for m in ("llmcompressor", "compressed_tensors", "transformers", "torch")
        },
    )
    tmp = args.out.with_suffix(".partial")
    tmp.write_text(json.dumps(row, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
