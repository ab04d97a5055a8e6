"""Conv2d + BatchNorm2d in QAT: train on the folded weights while BN keeps its batch statistics.

Training, BN not frozen (Jacob et al., 2018; torch.ao's ``_ConvBnNd``): the weight is scaled by
``gamma / running_std`` and fake-quantized — the per-channel range the int8 weight will have —
the convolution's output is scaled back, and BatchNorm normalises it with the batch statistics
(updating its running statistics as usual). Frozen BN (after ``bn_freeze_step`` training steps)
and eval mode: the convolution runs with ``fold_conv_bn`` of the running statistics, the very
function ``qfuse.convert`` folds with, so eval-mode fake quant predicts the converted layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qfuse.flows.qat.modules import WeightFakeQuant
from qfuse.fusion.bn_fold import fold_conv_bn


class ConvBnFakeQuant(nn.Module):
    """Called as ``(x, weight, bias, gamma, beta, running_mean, running_var)``: the tensors stay
    the captured model's own parameters and buffers (so the trained values keep their names)."""

    def __init__(
        self,
        conv: dict,
        eps: float,
        momentum: float | None,
        weight_fq: WeightFakeQuant,
        freeze_step: int | None,
        layer_name: str,
    ) -> None:
        super().__init__()
        self.conv = dict(conv)  # stride, padding, dilation, groups
        self.eps, self.momentum = eps, momentum
        self.weight_fq = weight_fq
        self.freeze_step, self.layer_name = freeze_step, layer_name
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    @property
    def bn_frozen(self) -> bool:
        return self.freeze_step is not None and int(self.step) >= self.freeze_step

    def _conv(self, x, weight, bias):
        c = self.conv
        return F.conv2d(x, weight, bias, c["stride"], c["padding"], c["dilation"], c["groups"])

    def forward(self, x, weight, bias, gamma, beta, running_mean, running_var):
        training, frozen = self.training, self.bn_frozen
        if training:
            self.step += 1
        if not training or frozen:
            w, b = fold_conv_bn(weight, bias, gamma, beta, running_mean, running_var, self.eps)
            return self._conv(x, self.weight_fq(w), b)
        running_std = torch.sqrt(running_var + self.eps)
        factor = (gamma / running_std) if gamma is not None else 1.0 / running_std
        y = self._conv(x, self.weight_fq(weight * factor.reshape(-1, 1, 1, 1)), None)
        y = y / factor.reshape(1, -1, 1, 1)
        if bias is not None:
            y = y + bias.reshape(1, -1, 1, 1)
        return F.batch_norm(
            y, running_mean, running_var, gamma, beta, True, self.momentum or 0.0, self.eps
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer_name}, bn_freeze_step={self.freeze_step}"
