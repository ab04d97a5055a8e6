"""llm-compressor's W8A8 (SmoothQuant + GPTQ) on the trained Llama of ``calibration/llm/``: the
peer row of ``recipes.ptq_llm``, measured with the same data and metric code.

    /work/venv-llmc/bin/python bench/llm_peer.py --out /tmp/peer.json     # PYTHONPATH=. set
    python -m recipes.ptq_llm --peer /work/venv-llmc/bin/python             # runs this for you

llm-compressor 0.14 pins compressed-tensors 0.19 and transformers <= 5.17, which clash with
qfuse's environment, so it runs in a venv of its own (README, "A trained LLM"):

    python3 -m venv /work/venv-llmc
    /work/venv-llmc/bin/pip install "llmcompressor==0.14.*" "torch==2.13.0"

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
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from calibration import llm as data  # noqa: E402


def quantize(model, calib: torch.Tensor, alpha: float):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    inputs = calib[:, :-1]
    ds = Dataset.from_dict(
        {"input_ids": inputs.tolist(), "attention_mask": torch.ones_like(inputs).tolist()}
    )
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import llmcompressor

    model = data.load_model()
    held, valid = data.heldout_windows(args.heldout), data.validation_windows()
    ref_ppl, ref_greedy = data.score(model, held)
    prompts = data.prompts(held, args.prompts)
    ref_generated = data.generate(model, prompts)
    t0 = time.perf_counter()
    quantize(model, data.calibration_windows(args.calibration), args.alpha)
    seconds = time.perf_counter() - t0
    ppl, greedy = data.score(model, held)
    row = dict(
        config=f"llm-compressor {llmcompressor.__version__} W8A8, SmoothQuant {args.alpha} + GPTQ",
        perplexity=ppl,
        validation_perplexity=data.score(model, valid)[0],
        top1_agreement=(greedy == ref_greedy).float().mean().item(),
        generation_agreement=(data.generate(model, prompts) == ref_generated).float().mean().item(),
        sample=data.sample(model),
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
