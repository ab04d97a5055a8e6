"""Q, K and V as one GEMM: merged at prepare, same numbers as separate layers on the reference
path, skipped where a slice could not be viewed, and saved/loaded as one layer."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.state import get_state


class Attention(nn.Module):
    """Post-LN self-attention with separate q/k/v projections (BERT's layout)."""

    def __init__(self, d=32, heads=4, flatten=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.o, self.ln, self.heads, self.flatten = nn.Linear(d, d), nn.LayerNorm(d), heads, flatten

    def forward(self, x):
        b, s, d = x.shape
        if self.flatten:  # views that merge the leading dims need a contiguous tensor
            q, k, v = (p(x).view(b * s, d).view(b, s, d) for p in (self.q, self.k, self.v))
        else:
            q, k, v = (p(x) for p in (self.q, self.k, self.v))
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
        return self.ln(self.o(a.transpose(1, 2).reshape(b, s, d)) + x)


X = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))


def _convert(model, merge, cfg=None):
    p = qfuse.prepare(model, cfg or qfuse.QConfig.int8_static(), (X,), merge_siblings=merge)
    for i in range(3):
        p(torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(i + 1)))
    return p, qfuse.convert(p)


@pytest.mark.parametrize("cfg", ["int8_static", "fp8_static", "int8_dynamic"])
def test_merged_equals_separate_on_the_reference_path(cfg):
    torch.manual_seed(0)
    model = Attention().eval()
    p, merged = _convert(model, True, getattr(qfuse.QConfig, cfg)())
    _, separate = _convert(model, False, getattr(qfuse.QConfig, cfg)())
    assert get_state(p).merged == [["q", "k", "v"]]
    names = [r["name"] for r in qfuse.summary(merged).rows]
    assert names[0] == "q_k_v" and "q" not in names
    assert torch.equal(merged(X), separate(X))


def test_not_merged_when_a_reader_needs_a_contiguous_tensor():
    torch.manual_seed(0)
    model = Attention(flatten=True).eval()
    p, q = _convert(model, True)
    assert get_state(p).merged == []
    torch.testing.assert_close(q(X), model(X), rtol=0.1, atol=0.1)


def test_triton_merged_layer_matches_reference(device):
    torch.manual_seed(0)
    _, q = _convert(Attention().eval(), True)
    ref = q(X)
    with qfuse.use_backend("triton"):
        out = q.to(device)(X.to(device)).cpu()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # LayerNorm rounding


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Attention().eval()
    _, q = _convert(model, True)
    path = os.path.join(tmp_path, "m.safetensors")
    qfuse.save(q, path)
    loaded = qfuse.load(path, model, (X,))
    assert torch.equal(loaded(X), q(X))
    assert get_state(loaded).merged == [["q", "k", "v"]]
