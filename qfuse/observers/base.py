"""The observer contract: watch a tensor during calibration, then name its quantization params.

An observer is an identity ``nn.Module``: ``forward(x)`` records statistics of ``x`` (after
checking it is finite) and returns ``x`` unchanged. All state lives in registered buffers, so a
prepared model can be moved, saved and reloaded mid-calibration. ``calculate_qparams`` turns
the statistics into ``(scale float32, zero_point int32)`` with the conventions of
``qfuse.primitives.choose_qparams``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from qfuse.errors import CalibrationError, UnsupportedError
from qfuse.primitives import INT8_MAX, INT8_MIN, choose_qparams


class Recorder(nn.Module, metaclass=abc.ABCMeta):
    """An identity module that records statistics of what passes through it during calibration.

    ``enabled`` off makes it a pure identity (evaluating a prepared model must not calibrate).
    Buffers whose shape only the first batch fixes adopt the shapes of a calibrated state dict,
    so one loads into a fresh recorder (as torch.ao's observers do).
    """

    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.enabled = True

    def _check_finite(self, x: torch.Tensor, batch: int) -> None:
        if not bool(torch.isfinite(x).all()):
            bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
            raise CalibrationError(
                f"{self.layer_name}: calibration batch {batch} contains {bad}. "
                "Clean the calibration data (or find the op that overflows upstream) and run the "
                "calibration again; a non-finite range would give a meaningless scale."
            )

    # Merging ------------------------------------------------------------------------------------
    def merge(self, other: Recorder) -> Recorder:
        """Fold ``other``'s statistics into this recorder, in place, as if ``other``'s batches had
        come after this one's; returns ``self``. Both must watch the same thing with the same
        settings. A side that saw no data changes nothing (the other side's state is taken).
        ``qfuse.observers.distributed.sync`` merges one recorder across ``torch.distributed``
        ranks, in rank order, with this method.
        """
        if type(other) is not type(self) or self._merge_key() != other._merge_key():
            raise UnsupportedError(
                f"{self.layer_name}: cannot merge {type(other).__name__}({other._merge_key()}) "
                f"into {type(self).__name__}({self._merge_key()}); merge observers of one kind "
                "and one configuration (the same prepared model on every process)."
            )
        if int(other.num_batches) == 0:
            return self
        if int(self.num_batches) == 0:
            for name, buf in other._buffers.items():
                if buf is not None:
                    self._buffers[name] = buf.detach().clone().to(self._device())
            self._after_merge()
            return self
        self._check_mergeable(other)
        self._merge_stats(other)
        self.num_batches += other.num_batches.to(self.num_batches.device)
        self._after_merge()
        return self

    def _device(self) -> torch.device:
        return self.num_batches.device

    def _merge_key(self) -> tuple:
        """The settings two recorders must share to be merged."""
        return ()

    def _check_mergeable(self, other: Recorder) -> None:
        """Raise if ``other``'s statistics have another layout (both saw data)."""

    @abc.abstractmethod
    def _merge_stats(self, other: Recorder) -> None:
        """Fold ``other``'s statistics (both non-empty) into this recorder's, except the batch
        count, which ``merge`` adds."""

    def _after_merge(self) -> None:
        """Hook for caches that new statistics invalidate."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, buf in self._buffers.items():
            incoming = state_dict.get(prefix + name)
            if buf is not None and incoming is not None and incoming.shape != buf.shape:
                self._buffers[name] = torch.empty(
                    incoming.shape, dtype=buf.dtype, device=buf.device
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Observer(Recorder):
    """Base class. Subclasses implement ``observe(x)`` and ``value_range()``.

    Args:
        symmetric: symmetric (zero point 0) or affine qparams.
        qmin, qmax: the integer range the qparams target.
        channel_axis: ``None`` for one range per tensor, else the axis that gets its own range.
        layer_name: the layer (or value) this observer watches; every error message names it.
    """

    def __init__(
        self,
        *,
        symmetric: bool = True,
        qmin: int = INT8_MIN,
        qmax: int = INT8_MAX,
        channel_axis: int | None = None,
        layer_name: str = "<unnamed>",
    ) -> None:
        super().__init__(layer_name)
        self.symmetric = symmetric
        self.qmin, self.qmax = qmin, qmax
        self.channel_axis = channel_axis
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.int64))
        self.register_buffer("num_channels", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or not x.is_floating_point() or x.numel() == 0:
            return x  # an empty batch carries no range information (torch.ao skips it too)
        if self.channel_axis is not None:
            self._check_channels(x.shape[self.channel_axis])
        xd = x.detach()
        self._check_finite(xd, int(self.num_batches) + 1)
        self.observe(xd.float())
        self.num_batches += 1
        return x

    def _check_channels(self, channels: int) -> None:
        if int(self.num_batches) == 0:
            self.num_channels.fill_(channels)
        elif int(self.num_channels) != channels:
            raise CalibrationError(
                f"{self.layer_name}: a calibration batch has {channels} channels along axis "
                f"{self.channel_axis}, earlier ones had {int(self.num_channels)}. Feed batches "
                "of the same layout (per-channel ranges cannot be merged across layouts)."
            )

    def _merge_key(self) -> tuple:
        return (self.symmetric, self.qmin, self.qmax, self.channel_axis)

    def _check_mergeable(self, other: Recorder) -> None:
        if self.channel_axis is not None and int(self.num_channels) != int(other.num_channels):
            raise CalibrationError(
                f"{self.layer_name}: cannot merge {int(other.num_channels)} channels into "
                f"{int(self.num_channels)}: every process must calibrate batches of one layout."
            )

    @abc.abstractmethod
    def observe(self, x: torch.Tensor) -> None:
        """Fold batch ``x`` (float32, detached, finite, non-empty) into the statistics."""

    @abc.abstractmethod
    def value_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) the qparams must cover: scalars, or one entry per channel."""

    def _per_channel_view(self, x: torch.Tensor) -> torch.Tensor:
        """x as [channels, everything else]."""
        return x.movedim(self.channel_axis, 0).reshape(x.shape[self.channel_axis], -1)

    def check_calibrated(self) -> None:
        if int(self.num_batches) == 0:
            raise CalibrationError(
                f"{self.layer_name}: no calibration data reached this layer. Run calibration "
                "batches through the prepared model (prepared(batch)) before qfuse.convert, and "
                "check that the batches take the code path that uses this layer."
            )

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_calibrated()
        lo, hi = self.value_range()
        if bool(((hi - lo) == 0).all()) and bool((hi == 0).all()):
            raise CalibrationError(
                f"{self.layer_name}: every calibration value was exactly 0, so no scale fits. "
                "Calibrate with representative (non-zero) inputs, or keep this layer in float "
                "by excluding it from quantization."
            )
        return choose_qparams(lo, hi, symmetric=self.symmetric, qmin=self.qmin, qmax=self.qmax)

    def extra_repr(self) -> str:
        return f"layer={self.layer_name}, symmetric={self.symmetric}, axis={self.channel_axis}"


@contextlib.contextmanager
def observers_disabled(model: nn.Module) -> Iterator[None]:
    """Run a prepared model as the float model it wraps, without recording statistics (every
    ``Recorder``: observers and GPTQ's input Hessians).

    Example:
        >>> import torch
        >>> from qfuse.observers import MinMaxObserver
        >>> obs = MinMaxObserver()
        >>> with observers_disabled(torch.nn.Sequential(obs)):
        ...     _ = obs(torch.ones(2))
        >>> int(obs.num_batches)
        0
    """
    observers = [m for m in model.modules() if isinstance(m, Recorder)]
    previous = [o.enabled for o in observers]
    for o in observers:
        o.enabled = False
    try:
        yield
    finally:
        for o, flag in zip(observers, previous, strict=False):
            o.enabled = flag
