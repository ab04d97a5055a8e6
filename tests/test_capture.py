import torch
from torch import nn

from qfuse.pipeline.capture import capture, follow_input_device


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


def test_a_view_as_example_input_does_not_pin_later_inputs():
    """Captured from a slice of a batch (a view: export guards it through its base), the model
    must still take tensors of their own; it failed with "'NoneType' object has no attribute
    'size'" (QAT on the trained Llama; sequential calibration on torch 2.11)."""
    import qfuse

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    big = torch.randn(10, 9)
    x = torch.randn(4, 8)
    prepared = qfuse.prepare(model.eval(), qfuse.QConfig.int8_static(), (big[1:5, :8],))
    assert prepared(x).shape == (4, 4)
    qat = qfuse.prepare_qat(model.train(), qfuse.QConfig.int8_static(), (big[1:5, :8],))
    assert qat(x).shape == (4, 4)
