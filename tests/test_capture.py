import torch
from torch import nn

from qfuse.capture import capture, follow_input_device


class MakesPositions(nn.Module):
    def forward(self, x):
        return x + torch.arange(x.shape[-1], device=x.device)


def test_device_constants_follow_the_input():
    gm = capture(MakesPositions(), (torch.randn(2, 5),))
    constants = [
        v
        for n in gm.graph.nodes
        for v in (*n.args, *n.kwargs.values())
        if isinstance(v, torch.device)
    ]
    assert constants == []
    assert follow_input_device(gm) == 0  # nothing left to rewrite
    out = gm.to("meta")(torch.randn(3, 5, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 5)


def test_batch_dimension_is_dynamic_by_default():
    gm = capture(nn.Linear(4, 3), (torch.randn(2, 4),))
    assert gm(torch.randn(7, 4)).shape == (7, 3)
