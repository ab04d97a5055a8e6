"""Quantization configs: frozen, validated dataclasses with presets and a versioned dict form.

Granularity is a type, not a string: ``PerTensor()``, ``PerChannel(axis)``, ``PerToken()``.
8-bit weights are always symmetric (zero point 0), which keeps the fused GEMM free of a weight
zero-point correction; ``symmetric`` chooses the activation scheme. 4-bit weights
(``weight_bits=4``: W4A16 with ``weight_only``, else W4A8) have group scales along K
(``group_size``) and, with ``weight_symmetric=False``, zero points (``qfuse.int4``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from qfuse.errors import UnsupportedError
from qfuse.int4 import check_group_size
from qfuse.observers import OBSERVER_REGISTRY

CONFIG_VERSION = 1


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per slice along ``axis`` (axis 0 of a weight = one scale per output channel)."""

    axis: int = 0


@dataclass(frozen=True)
class PerToken:
    """One scale per row of the activation, computed at run time (dynamic quantization)."""


Granularity = PerTensor | PerChannel | PerToken
_GRANULARITIES = {cls.__name__: cls for cls in (PerTensor, PerChannel, PerToken)}

SUPPORTED_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in SUPPORTED_DTYPES.items():
        if d == dtype:
            return name
    raise UnsupportedError(
        f"QConfig dtype {dtype} is not supported; use torch.int8 or torch.float8_e4m3fn."
    )


@dataclass(frozen=True)
class QConfig:
    """How weights and activations of the fused layers are quantized.

    Example:
        >>> import torch, qfuse
        >>> cfg = qfuse.QConfig.int8_static()
        >>> cfg.weight_granularity, cfg.activation_granularity
        (PerChannel(axis=0), PerTensor())
        >>> qfuse.QConfig.from_dict(cfg.to_dict()) == cfg
        True
        >>> fp8 = qfuse.QConfig.fp8_dynamic()
        >>> fp8.dtype, fp8.is_dynamic, qfuse.QConfig.from_dict(fp8.to_dict()) == fp8
        (torch.float8_e4m3fn, True, True)
    """

    dtype: torch.dtype = torch.int8
    weight_granularity: Granularity = field(default_factory=PerChannel)
    activation_granularity: Granularity = field(default_factory=PerTensor)
    symmetric: bool = True
    observer: str = "minmax"
    weight_bits: int = 8
    group_size: int | None = None  # 4-bit only: columns per weight scale; None: per channel
    weight_symmetric: bool = True  # 4-bit only: False gives each group a zero point
    weight_only: bool = False  # 4-bit only: float activations (W4A16)

    def __post_init__(self) -> None:
        self._check_weight_bits()
        if not isinstance(self.symmetric, bool):  # "no" would count as True
            raise UnsupportedError(f"QConfig symmetric={self.symmetric!r}: pass True or False.")
        if not isinstance(self.observer, str):
            raise UnsupportedError(f"QConfig observer={self.observer!r}: pass an observer name "
                                   f"({', '.join(sorted(OBSERVER_REGISTRY))}).")
        if not isinstance(self.dtype, torch.dtype):
            raise UnsupportedError(f"QConfig dtype={self.dtype!r}: pass torch.int8 or "
                                   "torch.float8_e4m3fn.")
        _dtype_name(self.dtype)
        if not isinstance(self.weight_granularity, (PerTensor, PerChannel)):
            raise UnsupportedError(
                f"weight_granularity {self.weight_granularity!r}: use PerChannel(0) or PerTensor()."
            )
        if isinstance(self.weight_granularity, PerChannel) and self.weight_granularity.axis != 0:
            raise UnsupportedError(
                "weight_granularity PerChannel(axis) supports axis=0 (output channels) only."
            )
        if not isinstance(self.activation_granularity, (PerTensor, PerToken)):
            raise UnsupportedError(
                f"activation_granularity {self.activation_granularity!r}: use PerTensor() "
                "(static) or PerToken() (dynamic)."
            )
        if self.observer not in OBSERVER_REGISTRY:
            raise UnsupportedError(
                f"observer {self.observer!r} unknown; choose one of {sorted(OBSERVER_REGISTRY)}."
            )
        if self.dtype == torch.float8_e4m3fn and not self.symmetric:
            raise UnsupportedError("fp8 quantization is symmetric only: set symmetric=True.")
        if self.is_dynamic and not self.symmetric:
            raise UnsupportedError(
                "dynamic (PerToken) activation quantization is symmetric only: set symmetric=True."
            )

    def _check_weight_bits(self) -> None:
        if self.weight_bits not in (4, 8) or isinstance(self.weight_bits, bool):
            raise UnsupportedError(f"QConfig weight_bits={self.weight_bits!r}: use 8 or 4.")
        if self.weight_bits == 8:
            extra = [name for name, default in (("group_size", None), ("weight_symmetric", True),
                                                ("weight_only", False))
                     if getattr(self, name) != default]
            if extra:
                raise UnsupportedError(
                    f"QConfig {extra} apply to 4-bit weights only: set weight_bits=4 "
                    "(QConfig.w4a16() / QConfig.w4a8()) or drop them.")
            return
        check_group_size(self.group_size, "QConfig group_size")
        if not isinstance(self.weight_symmetric, bool) or not isinstance(self.weight_only, bool):
            raise UnsupportedError("QConfig weight_symmetric / weight_only: pass True or False.")
        if self.dtype != torch.int8:
            raise UnsupportedError("4-bit weights run with float (weight_only=True) or int8 "
                                   "activations; set dtype=torch.int8.")
        if not self.weight_only and not self.symmetric:
            raise UnsupportedError("W4A8 quantizes activations symmetrically: set symmetric=True.")

    @property
    def is_dynamic(self) -> bool:
        return isinstance(self.activation_granularity, PerToken)

    # Presets ------------------------------------------------------------------------------------
    @classmethod
    def int8_static(cls) -> QConfig:
        """Symmetric per-channel int8 weights, static per-tensor int8 activations, MinMax."""
        return cls()

    @classmethod
    def int8_static_asymmetric(cls) -> QConfig:
        """As ``int8_static`` but activations get a zero point (better after ReLU/GELU)."""
        return cls(symmetric=False)

    @classmethod
    def int8_dynamic(cls) -> QConfig:
        """Symmetric per-channel int8 weights, int8 activations with per-token scales computed at
        run time (no calibration-dependent activation scale; a quantize pass per layer)."""
        return cls(activation_granularity=PerToken())

    @classmethod
    def fp8_static(cls) -> QConfig:
        """float8 e4m3 weights (per-channel scale) and activations (static per-tensor scale)."""
        return cls(dtype=torch.float8_e4m3fn)

    @classmethod
    def fp8_dynamic(cls) -> QConfig:
        """float8 e4m3 weights (per-channel) and activations with per-token run-time scales."""
        return cls(dtype=torch.float8_e4m3fn, activation_granularity=PerToken())

    @classmethod
    def w4a16(cls, group_size: int | None = 128, symmetric: bool = True) -> QConfig:
        """4-bit weights in groups of ``group_size`` along K (None: per channel), symmetric or
        with zero points; float activations. Needs no calibration (GPTQ / AWQ do)."""
        return cls(activation_granularity=PerToken(), weight_bits=4, group_size=group_size,
                   weight_symmetric=symmetric, weight_only=True)

    @classmethod
    def w4a8(cls, group_size: int | None = 128, symmetric: bool = True,
             dynamic: bool = True) -> QConfig:
        """4-bit group weights, int8 activations: per token at run time (``dynamic``) or one
        static scale from calibration; the int4 codes feed the int8 product group by group."""
        act = PerToken() if dynamic else PerTensor()
        return cls(activation_granularity=act, weight_bits=4, group_size=group_size,
                   weight_symmetric=symmetric)

    # Dict form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out: dict = {"version": CONFIG_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = _dtype_name(value)
            elif isinstance(value, (PerTensor, PerChannel, PerToken)):
                value = {"type": type(value).__name__, **value.__dict__}
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> QConfig:
        data = dict(data)
        version = data.pop("version", CONFIG_VERSION)
        if version > CONFIG_VERSION:
            raise UnsupportedError(
                f"QConfig version {version} is newer than this qfuse understands "
                f"({CONFIG_VERSION}); upgrade qfuse."
            )
        kwargs = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name == "dtype":
                if value not in SUPPORTED_DTYPES:
                    raise UnsupportedError(f"QConfig dtype {value!r} is not supported.")
                value = SUPPORTED_DTYPES[value]
            elif isinstance(value, dict) and "type" in value:
                args = {k: v for k, v in value.items() if k != "type"}
                value = _GRANULARITIES[value["type"]](**args)
            kwargs[f.name] = value
        return cls(**kwargs)


def config_for(name: str, config: QConfig, layer_configs=None) -> QConfig:
    """The config of layer ``name``: the first ``layer_configs`` glob that matches it, else
    ``config``.

    Example:
        >>> static, dynamic = QConfig.int8_static(), QConfig.int8_dynamic()
        >>> config_for("model.layers.3.mlp.down_proj", static, {"*.down_proj": dynamic}).is_dynamic
        True
    """
    import fnmatch

    for pattern, layer_config in (layer_configs or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return layer_config
    return config
