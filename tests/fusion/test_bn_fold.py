import torch
from torch import nn

from qfuse.fusion.bn_fold import fold_batchnorm
from qfuse.pipeline.capture import capture
from tests.models import ConvNet, randomize_batchnorm


def test_folding_preserves_outputs_and_removes_batchnorm():
    model = randomize_batchnorm(ConvNet())
    x = torch.randn(3, 1, 8, 8)
    gm = capture(model, (x,))
    folded = fold_batchnorm(gm)
    assert folded == ["bn1.weight", "bn2.weight"]
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not any("batch_norm" in t for t in targets)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_capture_switches_to_eval_so_batchnorm_folds():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    gm = capture(model, (torch.randn(2, 1, 5, 5),))  # capture puts the model in eval mode
    assert fold_batchnorm(gm) == ["1.weight"]
