"""QAT of a small Hugging Face BERT (random weights): train-mode capture with dropout and attention
dropout, SmoothQuant carried over from PTQ, and the recipe's distillation pieces."""

import pytest
import torch

import qfuse
from qfuse.flows.qat.graph import AttentionDropout

transformers = pytest.importorskip("transformers")


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    model = transformers.BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 64, (4, 12))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_bert_qat_follows_modes_and_converts_like_its_fake_quant():
    model, batch = tiny_bert()
    config = qfuse.QConfig.int8_static_asymmetric()
    prepared = qfuse.prepare(
        model.eval(), config, (), example_kwargs=batch, smoothquant=qfuse.SmoothQuant(0.5)
    )
    with torch.no_grad():
        prepared(**batch)
    qat = qfuse.prepare_qat(model.train(), config, (), example_kwargs=batch, from_prepared=prepared)
    assert any(isinstance(m, AttentionDropout) for m in qat.modules())
    hidden = lambda m: m(**batch)["last_hidden_state"]  # noqa: E731
    assert not torch.equal(hidden(qat), hidden(qat))  # dropout in train mode
    opt = torch.optim.AdamW(qat.parameters(), lr=1e-4)
    for _ in range(2):
        loss = hidden(qat).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    with torch.no_grad():
        fq = hidden(qat)
        assert torch.equal(fq, hidden(qat))  # eval: no dropout
        qmodel = qfuse.convert(qat)
        out = hidden(qmodel)
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), fq.flatten(1)).min()
    assert cos > 0.9999
    notes = [r["note"] for r in qfuse.summary(qmodel).rows if "prologue" in r["note"]]
    assert notes, "SmoothQuant's prologue factors carried over"


def test_distillation_loss_is_zero_for_the_teacher_and_positive_otherwise():
    from qfuse.recipes.qat_minilm import distill_loss, without_dropout

    model, batch = tiny_bert()
    student = without_dropout(model)
    assert student.training and all(
        m.p == 0.0 for m in student.modules() if isinstance(m, torch.nn.Dropout)
    )
    with torch.no_grad():
        teacher = model.eval()(**batch)["last_hidden_state"]
        same = distill_loss(teacher, teacher, batch["attention_mask"])
        other = distill_loss(teacher * 1.1 + 0.1, teacher, batch["attention_mask"])
    assert abs(float(same)) < 1e-6 and float(other) > 1e-3
