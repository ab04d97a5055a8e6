"""QAT on gated MLPs (SwiGLU / GeGLU): prepare_qat merges gate and up into one layer as prepare
does, trains the merged weight through ``qfuse::gated``, and converts to the same fused layer;
tiny Llama, Qwen2 and Mistral configurations train, convert and generate."""

import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.state import get_state
from tests.qat.test_qat_flow import assert_agrees, train


class GatedMLP(nn.Module):
    """Llama's MLP with a residual: down(act(gate(x)) * up(x)) + x."""

    def __init__(self, d=32, hidden=48, act=None):
        super().__init__()
        self.gate, self.up = nn.Linear(d, hidden), nn.Linear(d, hidden)
        self.down, self.act = nn.Linear(hidden, d), act or nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x)) + x


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU()], ids=["swiglu", "geglu"])
def test_merged_gate_up_trains_and_converts_like_its_fake_quant(act):
    torch.manual_seed(0)
    model, x = GatedMLP(act=act).train(), torch.randn(16, 32)
    qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,))
    assert get_state(qat).merged == [["gate", "up"]]
    merged = qat.get_parameter("gate_up.weight")
    assert merged.requires_grad
    before = merged.detach().clone()
    train(qat, x, lr=1e-2)
    assert not torch.equal(merged.detach(), before)  # the gradient reached the merged weight
    qmodel = qfuse.convert(qat)
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert list(rows) == ["gate_up", "down"]
    assert rows["gate_up"]["output"] == "int8 to down"
    assert_agrees(qat, qmodel, x)


def test_frozen_members_keep_the_merged_weight_frozen():
    torch.manual_seed(0)
    model, x = GatedMLP().train(), torch.randn(16, 32)
    for p in (*model.gate.parameters(), *model.up.parameters()):
        p.requires_grad_(False)
    qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,))
    assert not qat.get_parameter("gate_up.weight").requires_grad
    assert not qat.get_parameter("gate_up.bias").requires_grad


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_llm_qat_converts_and_generates(family):
    pytest.importorskip("transformers")
    from tests import zoo_models

    torch.manual_seed(0)
    model, tokens, _ = getattr(zoo_models, family)()
    ids = tokens(batch=2, seq=8)["input_ids"]
    qat = qfuse.prepare_qat(model.train(), qfuse.QConfig.int8_static(), (), {"input_ids": ids})
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(2):
        loss = qat(input_ids=ids)["logits"].float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    qmodel = qfuse.convert(qat, output="model")
    assert type(qmodel) is type(model)
    assert sum(isinstance(m, QGatedMLP) for m in qmodel.modules()) == 2
    with torch.no_grad():
        fq, out = qat(input_ids=ids)["logits"], qmodel(input_ids=ids).logits
        cos = nn.functional.cosine_similarity(out.flatten(1), fq.flatten(1)).min()
        assert cos > 0.999, cos
        generated = qmodel.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4)
