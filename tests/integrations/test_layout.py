"""qfuse.integrations.layout: the modules convert(output="model") swapped in, described as JSON
and rebuilt onto a fresh float model (the part of save_pretrained/from_pretrained that does not
depend on transformers)."""

import json

import torch
from torch import nn

import qfuse
from qfuse.integrations.layout import describe, finish, rebuild
from qfuse.nn import QConv2d, QLinear
from qfuse.nn.qconv1d import QConv1d
from tests.models import randomize_batchnorm


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.audio = nn.Conv1d(8, 8, 3, padding=1)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))  # [B, 8, 4, 4]
        h = self.audio(h.flatten(2)).transpose(1, 2)  # [B, 16, 8]
        return self.head(torch.cat([self.q(h), self.k(h), self.v(h)], -1))


def test_describe_rebuild_finish_gives_the_same_model():
    torch.manual_seed(0)
    model, x = randomize_batchnorm(Net()).eval(), torch.randn(2, 3, 4, 4)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    qmodel = qfuse.convert(prepared, output="model")
    modules = json.loads(json.dumps(describe(qmodel)))  # what config.json holds
    assert {p: e["module"] for p, e in modules.items()} == {
        "conv": "QConv2d", "bn": "Identity", "audio": "QConv1d", "q": "QSibling",
        "k": "QSibling", "v": "QSibling", "head": "QLinear"}
    fresh = Net().eval()
    rebuild(fresh, modules)
    assert isinstance(fresh.bn, nn.Identity) and isinstance(fresh.audio, QConv1d)
    fresh.load_state_dict(qmodel.state_dict())
    finish(fresh, modules)
    assert isinstance(fresh.conv, QConv2d) and fresh.conv.weight.dtype == torch.float32
    assert isinstance(fresh.head, QLinear) and fresh.k.owner is fresh.q
    with torch.no_grad():
        assert torch.equal(fresh(x), qmodel(x))
