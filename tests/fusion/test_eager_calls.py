"""The converted graph's view ops as tensor methods (``fusion/eager_calls.py``)."""

from __future__ import annotations

import torch

import qfuse
from qfuse.fusion.eager_calls import tensor_methods

aten = torch.ops.aten
VIEW_OPS = {aten.view.default, aten.reshape.default, aten.transpose.int, aten.unsqueeze.default,
            aten.permute.default, aten.slice.Tensor}


class Heads(torch.nn.Module):
    """An attention-style split: merged projection, slices, head views, transposes."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)
        q, k, v = y[..., :16], y[..., 16:32], y[:, :, 32:]
        q = q.reshape(b, s, 4, 4).transpose(1, 2)
        k = k.view(b, s, 4, 4).permute(0, 2, 3, 1)
        att = (q @ k).softmax(-1) @ v.reshape(b, s, 4, 4).transpose(1, 2)
        return att.transpose(1, 2).reshape(b, s, 16)[:, 1:].unsqueeze(0)


def _aten_views(gm):
    return sum(n.op == "call_function" and n.target in VIEW_OPS for n in gm.graph.nodes)


def test_same_outputs_at_every_shape_no_aten_views_left():
    torch.manual_seed(0)
    dims = {"x": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    gm = torch.export.export(Heads(), (torch.randn(2, 5, 16),), dynamic_shapes=dims).module()
    inputs = [torch.randn(2, 5, 16), torch.randn(3, 9, 16), torch.randn(1, 4, 16)]
    before = [gm(x) for x in inputs]
    assert _aten_views(gm) >= 8
    assert tensor_methods(gm) >= 8
    assert _aten_views(gm) == 0
    for x, expected in zip(inputs, before, strict=True):
        assert torch.equal(gm(x), expected)


def test_convert_and_load_leave_no_aten_views(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    prepared = qfuse.prepare(Heads().eval(), qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    converted = qfuse.convert(prepared)
    assert _aten_views(converted) == 0
    path = tmp_path / "heads.safetensors"
    qfuse.save(converted, str(path))
    loaded = qfuse.load(str(path), Heads().eval(), (x,))
    assert _aten_views(loaded) == 0
    assert torch.equal(loaded(x), converted(x))
