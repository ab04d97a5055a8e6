"""The block types of torchvision's ResNets and MobileNetV3, written here (CI has no torchvision):
basic and bottleneck residual blocks (identity and projection shortcuts), the inverted residual
with a depthwise conv, squeeze-excitation and hardswish."""

from __future__ import annotations

import torch
from qfuse.recipes.ptq_resnet import (
    BasicBlock,  # the recipe's block: one definition, tested here too
)
from torch import nn
from torch.nn import functional as F


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * 4
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class SqueezeExcitation(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))
        return x * s


class InvertedResidual(nn.Module):
    """1x1 expand -> depthwise kxk -> [SE] -> 1x1 project (+ input when shapes match)."""

    def __init__(self, c_in, expand, c_out, k, stride, se: bool, act) -> None:
        super().__init__()
        self.expand = nn.Sequential(
            nn.Conv2d(c_in, expand, 1, bias=False), nn.BatchNorm2d(expand), act()
        )
        self.dw = nn.Sequential(
            nn.Conv2d(expand, expand, k, stride, k // 2, groups=expand, bias=False),
            nn.BatchNorm2d(expand),
            act(),
        )
        self.se = SqueezeExcitation(expand, max(8, expand // 4)) if se else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(expand, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.use_res = stride == 1 and c_in == c_out

    def forward(self, x):
        out = self.project(self.se(self.dw(self.expand(x))))
        return out + x if self.use_res else out


class TinyResNet(nn.Module):
    """Stem 3x3 -> basic blocks (identity and projection) -> bottleneck -> pool -> Linear."""

    def __init__(self, c: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(c, c)
        self.layer2 = BasicBlock(c, 2 * c, stride=2)
        self.layer3 = Bottleneck(2 * c, c, stride=2)
        self.fc = nn.Linear(4 * c, classes)

    def forward(self, x):
        x = F.max_pool2d(self.stem(x), 3, 1, 1)
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TinyMobileNet(nn.Module):
    """Hardswish stem -> inverted residuals (ReLU and Hardswish, with and without SE, ReLU6)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 32, 16, 3, 1, se=True, act=nn.ReLU),
            InvertedResidual(16, 48, 24, 5, 2, se=True, act=nn.Hardswish),
            InvertedResidual(24, 48, 24, 3, 1, se=False, act=nn.ReLU6),
        )
        self.head = nn.Sequential(nn.Conv2d(24, 64, 1), nn.Hardswish())
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def reestimate_batchnorm(model: nn.Module, make_batch, steps: int = 4) -> nn.Module:
    """BatchNorm statistics from random data (train mode, cumulative average), then eval: a
    random-weight model then has O(1) activations to quantize (see issue 11). ``make_batch()``
    returns the model's input, or a dict of keyword inputs. Shared by the tests, the zoo and
    ``bench/models/conv_networks.py``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            batch = make_batch()
            model(**batch) if isinstance(batch, dict) else model(batch)
    return model.eval()
