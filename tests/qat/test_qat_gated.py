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


class DropoutMLP(GatedMLP):
    """Dropout between the gate's activation and the product: train mode cannot merge gate/up
    (the product reads dropout's output), eval mode can (eval dropout is an identity)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.down(self.drop(self.act(self.gate(x))) * self.up(x)) + x


class ModeLeak(GatedMLP):
    """Reads the gate's output a second time in eval mode only: merged in train mode, not in eval."""

    def forward(self, x):
        g = self.act(self.gate(x))
        y = self.down(g * self.up(x)) + x
        return y if self.training else y + g.sum(-1, keepdim=True)


def test_convert_merges_exactly_what_qat_merged():
    """Before: 'layers [gate, gate_up, up] exist only in the train-mode or only in the eval-mode
    graph (code under `if self.training`?)'. The eval-mode graph now replays QAT's merges."""
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    qat = qfuse.prepare_qat(DropoutMLP().train(), qfuse.QConfig.int8_static(), (x,))
    assert get_state(qat).merged == []
    qmodel = qfuse.convert(train(qat, x))
    assert [r["name"] for r in qfuse.summary(qmodel).rows] == ["gate", "up", "down"]
    assert_agrees(qat, qmodel, x)


def test_a_merge_the_eval_graph_cannot_replay_is_named_as_a_merge():
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    qat = qfuse.prepare_qat(ModeLeak().train(), qfuse.QConfig.int8_static(), (x,))
    assert get_state(qat).merged == [["gate", "up"]]
    with pytest.raises(qfuse.GraphMismatchError) as err:
        qfuse.convert(train(qat, x))
    assert "pass merge_gated: QAT merged the layers [['gate', 'up']]" in str(err.value)
    assert "merge_siblings=False" in str(err.value)
    assert "if self.training" not in str(err.value)
    unmerged = qfuse.prepare_qat(ModeLeak().train(), qfuse.QConfig.int8_static(), (x,),
                                 merge_siblings=False)
    qfuse.convert(train(unmerged, x))  # the fix the message gives
