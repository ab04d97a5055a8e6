"""``fusion.pool_quant``: a conv whose max-pool is read only by fused convs requantizes for them
and the pool runs on int8/fp8 — exactly what pooling in float and quantizing gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qfuse
from qfuse.ops.pool import max_pool2d_call
from tests.cnn_blocks import reestimate_batchnorm


class StemPool(nn.Module):
    """conv -> bn -> relu -> maxpool, read by two convs (summed) and, optionally, a float op."""

    def __init__(self, float_reader: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.float_reader = float_reader

    def forward(self, x):
        p = self.pool(self.stem(x))
        y = self.b(p) + self.a(p)
        return y + p.mean() if self.float_reader else y


def _convert(model, config, **kw):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = reestimate_batchnorm(model, lambda: torch.randn(2, 3, 10, 10, generator=g))
    x = torch.randn(2, 3, 10, 10, generator=g)
    prepared = qfuse.prepare(model, config, example_inputs=(x,))
    prepared(x)
    return prepared, x


@pytest.mark.parametrize("config", [qfuse.QConfig.int8_static(),
                                    qfuse.QConfig.int8_static_asymmetric(),
                                    qfuse.QConfig.fp8_static()], ids=["int8", "asym", "fp8"])
def test_pool_runs_quantized_and_changes_nothing(config):
    prepared, x = _convert(StemPool(), config)
    pooled = qfuse.convert(prepared)
    plain = qfuse.convert(prepared, fuse_pools=False)
    assert any(n.target is max_pool2d_call for n in pooled.graph.nodes)
    assert not any(n.target is max_pool2d_call for n in plain.graph.nodes)
    rows = {r["name"]: r for r in qfuse.summary(pooled).rows}
    assert rows["stem.0"]["output"].endswith("through max_pool2d")  # the pool node
    assert rows["a"]["input"].startswith(("int8 from stem.0", "fp8_e4m3 from stem.0"))
    with torch.no_grad():  # max(q(y)) == q(max(y)): the readers see the same codes
        assert torch.equal(pooled(x), plain(x))


def test_pool_with_a_float_reader_stays_float():
    prepared, x = _convert(StemPool(float_reader=True), qfuse.QConfig.int8_static())
    qmodel = qfuse.convert(prepared)
    assert not any(n.target is max_pool2d_call for n in qmodel.graph.nodes)
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["stem.0"]["output"] == "float32"
