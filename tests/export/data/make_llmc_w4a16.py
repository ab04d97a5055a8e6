"""Regenerate the llm-compressor W4A16 fixtures ``tests/export/test_ct_int4.py`` loads.

Not a test and not run in CI: it needs llm-compressor (0.14 made the committed folders), which
qfuse's test set-up does not install. Run it with a Python that has llm-compressor::

    /tmp/lcvenv/bin/python tests/export/data/make_llmc_w4a16.py

For each scheme it builds a tiny random ``LlamaForCausalLM`` (hidden 64, intermediate 128, 2
layers, 4 heads / 2 KV heads, vocab 128, untied float32 ``lm_head``), quantizes every Linear but
``lm_head`` with llm-compressor's own ``oneshot`` (``GPTQModifier`` with compressed-tensors'
``W4A16`` / ``W4A16_ASYM`` preset, its group size set to 32) on a few random calibration
batches, writes it with ``save_pretrained(save_compressed=True)`` (``pack_quantized``), then loads
that folder back with transformers' compressed-tensors integration and stores its logits for
fixed input ids as ``llmc_reference.pt`` in the folder (``input_ids``, ``logits`` and the
versions that made them). Nothing of qfuse is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VOCAB = 128
SCHEMES = {"llmc_w4a16_g32": "W4A16", "llmc_w4a16_asym_g32": "W4A16_ASYM"}
GROUP = 32


def tiny_llama(seed: int, tmp: Path):
    """The random float model, saved to ``tmp`` and loaded back: oneshot reads the model's
    config.json from its ``name_or_path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    # a trained model's weights are wider than the 0.02 init: make the 4-bit rounding visible
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def tiny_tokenizer():
    """oneshot wants a processor when given a dataset; the dataset is token ids already, so a
    word-level one over the 128 ids serves (it is not saved: loading needs none)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                   unk_token="t0", pad_token="t0")


def quantize(model, preset: str, seed: int) -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.group_size = GROUP
    g = torch.Generator().manual_seed(seed + 1)
    calib = torch.randint(0, VOCAB, (8, 16), generator=g)
    ds = Dataset.from_dict({"input_ids": calib.tolist(),
                            "attention_mask": torch.ones_like(calib).tolist()})
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=calib.shape[1],
            num_calibration_samples=calib.shape[0], processor=tiny_tokenizer())


def reference(path: Path) -> dict:
    """llm-compressor's side of the check: transformers + compressed-tensors load the folder
    and run it (float32)."""
    import compressed_tensors
    import llmcompressor
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return {"input_ids": ids, "logits": logits.contiguous(),
            "versions": json.dumps({"llmcompressor": llmcompressor.__version__,
                                    "compressed_tensors": compressed_tensors.__version__,
                                    "transformers": transformers.__version__,
                                    "torch": torch.__version__,
                                    "loaded_as": type(model.model.layers[0].mlp.up_proj).__name__})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed, (name, preset) in enumerate(SCHEMES.items()):
        path = args.out / name
        if path.exists():
            shutil.rmtree(path)
        with tempfile.TemporaryDirectory() as tmp:  # save while oneshot's source still exists
            model = tiny_llama(seed, Path(tmp))
            quantize(model, preset, seed)
            model.save_pretrained(path, save_compressed=True)
        for extra in ("generation_config.json",):
            if (path / extra).exists():
                os.remove(path / extra)
        torch.save(reference(path), path / "llmc_reference.pt")
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"{path}: {size / 1024:.0f} KiB, {sorted(f.name for f in path.iterdir())}")


if __name__ == "__main__":
    main()
