"""Gate and up projections as one GEMM with a SwiGLU / GeGLU epilogue: merged at prepare (float
numbers unchanged), the product fused and handed to the down projection as int8, Triton equal
to the reference, saved/loaded as one layer, and split back for convert(output="model")."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.state import get_state

ACTS = {"swiglu": nn.SiLU(), "geglu": nn.GELU(), "geglu_tanh": nn.GELU(approximate="tanh")}


class MLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, d=32, hidden=48, act="swiglu", bias=False, leak=False):
        super().__init__()
        self.gate, self.up = nn.Linear(d, hidden, bias=bias), nn.Linear(d, hidden, bias=bias)
        self.down, self.act, self.leak = nn.Linear(hidden, d, bias=bias), ACTS[act], leak

    def forward(self, x):
        g = self.act(self.gate(x))
        y = self.down(g * self.up(x)) + x
        return y + g.sum(-1, keepdim=True) if self.leak else y  # leak: gate read twice


X = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))


def _prepare(model, merge=True, cfg=None):
    p = qfuse.prepare(model, cfg or qfuse.QConfig.int8_static(), (X,), merge_siblings=merge)
    for i in range(3):
        p(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(i + 1)))
    return p


@pytest.mark.parametrize("act", list(ACTS))
def test_merged_at_prepare_keeps_the_float_numbers(act):
    torch.manual_seed(0)
    model = MLP(act=act, bias=True).eval()
    p = _prepare(model)
    state = get_state(p)
    assert state.merged == [["gate", "up"]]
    name = {"swiglu": "SwiGLU", "geglu": "GeGLU", "geglu_tanh": "GeGLU(tanh)"}[act]
    assert [c.pattern for c in state.chains] == [f"Linear→{name}", "Linear→residual"]
    torch.testing.assert_close(p(X), model(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", ["int8_static", "fp8_static", "int8_dynamic"])
def test_fused_product_is_handed_to_down_and_matches_separate_layers(cfg):
    torch.manual_seed(0)
    model = MLP().eval()
    merged = qfuse.convert(_prepare(model, True, getattr(qfuse.QConfig, cfg)()))
    separate = qfuse.convert(_prepare(model, False, getattr(qfuse.QConfig, cfg)()))
    rows = {r["name"]: r for r in qfuse.summary(merged).rows}
    assert list(rows) == ["gate_up", "down"]
    # static: the epilogue writes the down projection's quantized input; dynamic: float
    expected = {"int8_static": "int8 to down", "fp8_static": "fp8_e4m3 to down"}
    assert rows["gate_up"]["output"] == expected.get(cfg, "float32")
    ref = model(X)
    for q in (merged, separate):
        err = ((q(X) - ref).norm() / ref.norm()).item()
        assert err < (0.05 if cfg != "fp8_static" else 0.1), err


def test_not_merged_when_the_gate_output_is_read_twice_or_merging_is_off():
    torch.manual_seed(0)
    assert get_state(_prepare(MLP(leak=True).eval())).merged == []
    assert get_state(_prepare(MLP().eval(), merge=False)).merged == []


def test_triton_gated_layer_matches_reference(device):
    torch.manual_seed(0)
    q = qfuse.convert(_prepare(MLP().eval()))
    ref = q(X)
    with qfuse.use_backend("triton"):
        q.to(device)
        for module in q.modules():
            if hasattr(module, "exact_epilogue"):
                module.exact_epilogue = True  # IEEE SiLU on the GPU: bit-exact int8 hand-off
        out = q(X.to(device)).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MLP().eval()
    q = qfuse.convert(_prepare(model))
    path = os.path.join(tmp_path, "m.safetensors")
    qfuse.save(q, path)
    loaded = qfuse.load(path, model, (X,))
    assert get_state(loaded).merged == [["gate", "up"]]
    assert torch.equal(loaded(X), q(X))


def test_model_output_splits_back_where_the_mlp_module_does_more():
    """MLP.forward adds a residual itself: the module cannot be swapped whole."""
    torch.manual_seed(0)
    model = MLP().eval()
    p = _prepare(model)
    graph, qmodel = qfuse.convert(p), qfuse.convert(p, output="model")
    assert type(qmodel) is MLP
    assert qmodel.gate.out_features == qmodel.up.out_features == 48
    notes = {r["name"]: r["note"] for r in qfuse.summary(qmodel).rows}
    assert "split back from the merged layer gate_up (SwiGLU runs" in notes["gate"]
    ref = model(X)
    for out in (graph(X), qmodel(X)):
        assert ((out - ref).norm() / ref.norm()).item() < 0.05


def test_tiny_llama_generates():
    from tests.zoo_models import build

    model, make, _ = build("llama")
    model.eval()
    p = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=make())
    assert sum(len(g) == 2 and g[0].endswith("gate_proj") for g in get_state(p).merged) == 2
    for i in range(4):
        p(**make(seed=1 + i))
    graph, qmodel = qfuse.convert(p), qfuse.convert(p, output="model")
    mlp = qmodel.model.layers[0].mlp
    assert type(mlp) is QGatedMLP and mlp.gate_up.activation == "swiglu"
    assert mlp.intermediate_size == 128  # the float MLP's attributes stay readable
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["model.layers.0.mlp.gate_up"]["output"] == "int8 to model.layers.0.mlp.down"
    assert rows["model.layers.0.mlp.down"]["input"] == "int8 from model.layers.0.mlp.gate_up"
    x = make(seed=9)
    ref = model(**x).logits
    out = graph(**x)
    out = out["logits"] if isinstance(out, dict) else out[0]
    assert torch.equal(qmodel(**x).logits, out)  # the same fused numbers as the graph
    assert ((out - ref).norm() / ref.norm()).item() < 0.05
    ids = x["input_ids"][:1, :4]
    tokens = qmodel.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, 7)
