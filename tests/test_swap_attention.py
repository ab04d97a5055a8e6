"""convert(output="model") on torch's own attention modules: nn.MultiheadAttention computes its
projections from its children's weights in its own forward, and nn.TransformerEncoderLayer has a
fused fast path over its float weights; both keep working with the quantized layers swapped in."""

import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn import QLinear


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def _encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("build", [Attend, _encoder], ids=["mha", "encoder"])
def test_torch_attention_modules_run_swapped(build):
    torch.manual_seed(0)
    model, x = build().eval(), torch.randn(2, 5, 16)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    qmodel = qfuse.convert(prepared, output="model")
    with torch.no_grad():  # eval + no grad: where torch takes its fused attention fast paths
        ref, out = model(x), qmodel(x)
    assert ((out - ref).norm() / ref.norm()) < 0.05
    swapped = [n for n, m in qmodel.named_modules() if isinstance(m, QLinear)]
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    out_proj = [n for n in rows if n.endswith("out_proj")]
    assert out_proj and all(rows[n]["precision"] == "float" for n in out_proj)
    assert all("MultiheadAttention computes it" in rows[n]["note"] for n in out_proj)
    assert swapped and not any(n.endswith("out_proj") for n in swapped)
    graph = qfuse.summary(qfuse.convert(prepared)).rows  # the graph still quantizes out_proj
    assert all(r["precision"] == "int8" for r in graph if r["name"].endswith("out_proj"))
