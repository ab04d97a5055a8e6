"""The modules prepare_qat inserts: activation and weight fake quant with observer-driven or
learnable (LSQ) scales, and a step counter for the freeze points."""

from __future__ import annotations

import torch
from torch import nn

from qfuse.errors import CalibrationError
from qfuse.flows.qat.distributed import sync_observer
from qfuse.flows.qat.fake_quant import (
    fake_quantize_activation,
    fake_quantize_per_token,
    fake_quantize_weight,
    weight_scale_like_convert,
)
from qfuse.observers import make_observer
from qfuse.observers.base import Observer
from qfuse.primitives import SCALE_EPS


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter FSDP2 sharded (a DTensor), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class ActivationFakeQuant(nn.Module):
    """Fake-quantizes a fused layer's input on the grid its converted prologue uses.

    Static: an observer (the QConfig's kind) watches training batches and sets ``scale`` /
    ``zero_point`` until ``freeze_step`` training steps have run; with ``learnable`` the scale is
    an ``nn.Parameter`` (LSQ) that the observer only initialises, on the first training batch
    (under FSDP2, run that batch, or start from a PTQ model, before ``fully_shard``: a sharded
    parameter does not keep what a forward writes into it). Under ``torch.distributed`` the
    observer statistics are all-reduced every step, so every rank holds the same scale. Dynamic
    (per-token) quantization has no scale to keep. ``smoothing`` (SmoothQuant's factors, carried
    over from a PTQ model) quantizes ``x / s`` through the prologue vector, as convert does.

    Also answers what convert asks an observer: ``calculate_qparams()``, ``symmetric``,
    ``channel_axis``.
    """

    channel_axis = None

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        dynamic: bool,
        observer: Observer | None,
        learnable: bool = False,
        freeze_step: int | None = None,
        smoothing: torch.Tensor | None = None,
        layer_name: str = "<unnamed>",
    ) -> None:
        super().__init__()
        self.dtype, self.dynamic, self.learnable = dtype, dynamic, learnable
        self.freeze_step, self.layer_name = freeze_step, layer_name
        self.observer = observer
        self.symmetric = observer.symmetric if observer is not None else True
        if learnable:  # shape (1,), not (): FSDP2's fully_shard refuses scalar parameters
            self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        else:
            self.register_buffer("scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.uint8))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("smoothing", smoothing)

    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        with torch.no_grad():
            self.scale.copy_(scale.reshape(self.scale.shape))
            self.zero_point.copy_(zero_point.reshape(()))
            self.initialized.fill_(1)

    @property
    def observing(self) -> bool:
        """True while training steps still update the scale from the observer."""
        if self.learnable:
            return not bool(self.initialized)
        return self.freeze_step is None or int(self.step) < self.freeze_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        if self.dynamic:
            return fake_quantize_per_token(x, self.dtype)
        if self.training and self.observing:
            seen = x.detach().float()
            if self.smoothing is not None:
                seen = seen * torch.reciprocal(self.smoothing)
            self.observer(seen)
            sync_observer(self.observer)
            self.set_qparams(*self.observer.calculate_qparams())
        if self.training:
            self.step += 1
        self.check_initialized()
        return fake_quantize_activation(
            x, self.scale, self.zero_point, self.dtype, smoothing=self.smoothing
        )

    def check_initialized(self) -> None:
        if not bool(self.initialized):
            raise CalibrationError(
                f"{self.layer_name}: no scale yet: the QAT model has not seen a training batch. "
                "Run at least one forward in train mode (or start from a calibrated PTQ model "
                "with prepare_qat(..., from_prepared=...)) before evaluating or converting."
            )

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (scale, zero point) the converted layer gets: the current, frozen ones."""
        self.check_initialized()
        scale = full_tensor(self.scale.detach()).reshape(())
        return scale.clamp(min=SCALE_EPS).clone(), self.zero_point.clone()

    def extra_repr(self) -> str:
        kind = "dynamic" if self.dynamic else ("learnable" if self.learnable else "observed")
        return f"layer={self.layer_name}, dtype={self.dtype}, scale={kind}"


class WeightFakeQuant(nn.Module):
    """Fake-quantizes a weight as convert will store it: symmetric, one scale per output channel
    (or one repeated), amax-based like ``primitives.weight_scale``, or learnable (LSQ, initialised
    from that amax scale on the first call)."""

    def __init__(
        self, *, dtype: torch.dtype, per_channel: bool, learnable: bool, out_channels: int
    ) -> None:
        super().__init__()
        self.dtype, self.per_channel, self.learnable = dtype, per_channel, learnable
        if learnable:
            self.scale = nn.Parameter(torch.ones(out_channels if per_channel else 1))
            self.register_buffer("initialized", torch.zeros((), dtype=torch.uint8))

    def current_scale(self, weight: torch.Tensor) -> torch.Tensor:
        """One scale per output channel: the learned one, or the one convert would compute."""
        if not self.learnable:
            return weight_scale_like_convert(weight, self.dtype, self.per_channel)
        if not bool(self.initialized):
            with torch.no_grad():
                start = weight_scale_like_convert(weight, self.dtype, self.per_channel)
                self.scale.copy_(start if self.per_channel else start[:1])
                self.initialized.fill_(1)
        return self.scale.expand(weight.shape[0])

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantize_weight(
            weight, self.current_scale(weight), self.dtype, self.per_channel
        )

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, per_channel={self.per_channel}, learnable={self.learnable}"


def make_activation_fq(config, qat, layer_name: str, observer=None, smoothing=None):
    """The ``ActivationFakeQuant`` for a layer input under QConfig ``config``."""
    if observer is None and not config.is_dynamic:
        observer = make_observer(config.observer, symmetric=config.symmetric, layer_name=layer_name)
    return ActivationFakeQuant(
        dtype=config.dtype,
        dynamic=config.is_dynamic,
        observer=observer,
        learnable=qat.learnable_scales,
        freeze_step=qat.observer_freeze_step,
        smoothing=smoothing,
        layer_name=layer_name,
    )
