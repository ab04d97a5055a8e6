import pytest
import torch
from torch import nn

from qfuse.fusion.patterns import find_chains
from qfuse.pipeline.capture import capture


def chains_of(model, *shape):
    return find_chains(capture(model.eval(), (torch.randn(*shape),)))


@pytest.mark.parametrize(
    "act, name",
    [
        (nn.ReLU(), "relu"),
        (nn.ReLU(inplace=True), "relu"),
        (nn.GELU(), "gelu"),
        (nn.GELU(approximate="tanh"), "gelu_tanh"),
        (nn.SiLU(), "silu"),
        (nn.Tanh(), "none"),
    ],
)
def test_activation_is_absorbed(act, name):
    chains, skipped = chains_of(nn.Sequential(nn.Linear(8, 8), act), 2, 8)
    assert [c.activation for c in chains] == [name] and skipped == []


def test_residual_through_eval_dropout():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.fc(x)) + x

    (chain,), _ = chains_of(Block(), 2, 8)
    assert chain.pattern == "Linear→residual" and chain.residual == "x"


def test_broadcasting_add_is_not_a_residual():
    class Bias(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("b", torch.ones(8))

        def forward(self, x):
            return self.fc(x) + self.b

    (chain,), _ = chains_of(Bias(), 2, 8)
    assert chain.residual is None


def test_value_with_two_readers_ends_the_chain():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y) * y  # y is needed unactivated too

    (chain,), _ = chains_of(Branch(), 2, 8)
    assert chain.activation == "none" and len(chain.nodes) == 1


def test_tied_weight_is_skipped_with_reason():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    chains, skipped = chains_of(Tied(), 2, 8)
    assert chains == [] and len(skipped) == 2
    assert all("shared" in s.reason for s in skipped)


def test_conv_chain_records_conv_arguments():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1, groups=1), nn.ReLU())
    (chain,), _ = chains_of(model, 1, 3, 9, 9)
    assert chain.kind == "conv2d" and chain.pattern == "Conv2d→ReLU"
    assert chain.conv == dict(stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=1)
