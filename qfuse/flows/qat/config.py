"""``QATConfig``: how QAT learns its scales (the quantization scheme itself is the QConfig)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from qfuse.errors import UnsupportedError

QAT_CONFIG_VERSION = 1


@dataclass(frozen=True)
class QATConfig:
    """Scale learning and freezing for ``qfuse.prepare_qat``.

    Args:
        learnable_scales: LSQ: activation and weight scales are parameters trained by the
            optimizer (with LSQ's gradient scaling); their observers only set the start value
            (first training batch, or the PTQ model's scales). Off: observers set the scales.
        observer_freeze_step: observers stop updating after this many training steps (each
            forward in train mode is one step); ``None`` never freezes them.
        bn_freeze_step: Conv+BatchNorm layers switch from batch statistics to their frozen
            running statistics after this many training steps; ``None`` never freezes them.

    Example:
        >>> import qfuse
        >>> cfg = qfuse.QATConfig(learnable_scales=True, bn_freeze_step=200)
        >>> qfuse.QATConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    learnable_scales: bool = False
    observer_freeze_step: int | None = None
    bn_freeze_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("observer_freeze_step", "bn_freeze_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise UnsupportedError(
                    f"QATConfig {name}={value!r}: give a number of training steps >= 0, or None "
                    "to never freeze."
                )

    def to_dict(self) -> dict:
        return {"version": QAT_CONFIG_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> QATConfig:
        data = dict(data)
        if data.pop("version", QAT_CONFIG_VERSION) > QAT_CONFIG_VERSION:
            raise UnsupportedError("QATConfig from a newer qfuse; upgrade qfuse.")
        return cls(**data)
