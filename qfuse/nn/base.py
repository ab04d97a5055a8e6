"""What every quantized runtime module shares: buffer layout rules and the qparam helpers."""

from __future__ import annotations

import abc
import operator

import torch
from torch import nn

import qfuse.ops  # noqa: F401  (registers the qfuse:: custom ops the modules call)
from qfuse.primitives import inverse


class QuantizedModule(nn.Module, abc.ABC):
    """Base of QLinear/QConv2d. All quantized state is in registered buffers (so ``.to("cuda")``
    moves it and ``state_dict`` saves it); layout flags are plain attributes set at build time.

    What a layer's kernel calls are made of is described once (``describe``: a ``GemmCall`` or
    ``ConvCall``), and in plain eager inference kept between calls (``layer_call``)."""

    # The input's and the output's quantization buffers (``_set_qparams``), in BUFFER_NAMES.
    QPARAM_BUFFERS = tuple(f"{prefix}_{suffix}" for prefix in ("x", "out")
                           for suffix in ("scale", "inv_scale", "zero_point"))

    @abc.abstractmethod
    def describe(self):
        """This layer's call description, from its buffers and attributes as they are now
        (every quantized module defines it: a subclass without it cannot be built)."""

    def _call_fields(self, *buffers: str) -> dict:
        """The description's fields every quantized module fills the same way (its buffers of
        those names, its activation and output dtype), and the ``buffers`` named."""
        b = self._buffers  # direct: nn.Module.__getattr__ costs more than the lookup
        names = ("weight", "scale", "bias", "x_inv_scale", "x_zero_point", "out_inv_scale",
                 "out_zero_point", *buffers)
        return {**{name: b[name] for name in names}, "act": self.activation,
                "out_dtype": self.out_dtype}

    def layer_call(self):
        """``describe()``, kept between calls (the eager hot path builds no description per
        call): rebuilt when a buffer is another tensor than the kept one's, or an attribute is
        set. In-place changes of a buffer (``load_state_dict``) keep it: it holds the tensors."""
        kept = self.__dict__.get("_kept_call")
        buffers = self._buffers
        if (kept is None or len(kept[0]) != len(buffers)
                or not all(map(operator.is_, kept[0], buffers.values()))):
            kept = self.__dict__["_kept_call"] = (tuple(buffers.values()), self.describe())
        return kept[1]

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self.__dict__.pop("_kept_call", None)  # an attribute the description may read changed

    def _init_buffers(self, weight_shape: tuple, out_channels: int) -> None:
        """The buffers and attributes every quantized module starts with (``from_float`` or
        ``from_layout`` fills them in)."""
        self.activation = "none"
        self.out_dtype = torch.float32
        self._input_quantized = False
        self.register_buffer("weight", torch.zeros(weight_shape, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_channels))
        self.register_buffer("scale", torch.ones(out_channels))
        self.register_buffer("bias", None)

    def _apply(self, fn, recurse=True):
        # model.half() / .to(torch.bfloat16) apply to every floating buffer — float8 weights too —
        # and a round trip through fp16 rounds float32 scales and biases. So a buffer whose dtype
        # changed, or every buffer when ``fn`` casts floats (a float32 probe changes dtype), is
        # restored from before: only the device may change.
        cast = fn(torch.zeros((), dtype=torch.float32)).dtype != torch.float32
        before = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        self.__dict__.pop("_kept_call", None)  # it holds the old tensors
        if hasattr(self, "_launch_cache"):  # compiled kernels belong to the old device
            self._launch_cache = {}
        for name, old in before.items():
            new = self._buffers[name]
            if cast or new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        # A float output follows the cast, as an nn.Linear's would (a bf16 model computes in
        # bf16 from layer to layer); an int8/fp8 hand-off to the next kernel stays as it is.
        if self.out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            self.out_dtype = fn(torch.zeros((), dtype=self.out_dtype)).dtype
        return self

    def __getstate__(self):
        # deepcopy/pickle: compiled-kernel launch plans belong to this process and device (and
        # the kept call description is rebuilt from the copy's own buffers)
        state = self.__dict__.copy()
        state.pop("_kept_call", None)
        if "_launch_cache" in state:
            state["_launch_cache"] = {}
        return state

    def _set_qparams(self, prefix: str, scale, zero_point) -> None:
        """Buffers ``{prefix}_scale``, ``{prefix}_inv_scale``, ``{prefix}_zero_point`` (or None)."""
        if scale is None:
            for suffix in ("scale", "inv_scale", "zero_point"):
                self.register_buffer(f"{prefix}_{suffix}", None)
            return
        scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
        self.register_buffer(f"{prefix}_scale", scale)
        self.register_buffer(f"{prefix}_inv_scale", inverse(scale))
        zp = None
        if zero_point is not None and int(zero_point) != 0:
            zp = torch.as_tensor(zero_point, dtype=torch.int32).reshape(())
        self.register_buffer(f"{prefix}_zero_point", zp)

    # Plain (non-tensor) attributes that, with the buffers, fully describe a built module.
    LAYOUT_FIELDS: tuple[str, ...] = ("activation", "out_dtype", "_input_quantized")
    # Layout fields added later, with the value a file written before them means.
    LAYOUT_DEFAULTS: dict = {}

    def layout(self) -> dict:
        """JSON-able description of the non-tensor state (dtypes as their names)."""
        out = {}
        for name in self.LAYOUT_FIELDS:
            value = getattr(self, name)
            out[name] = (
                str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
            )
        out["buffers"] = sorted(k for k, v in self._buffers.items() if v is not None)
        return out

    @classmethod
    def from_layout(cls, layout: dict, tensors: dict[str, torch.Tensor]) -> QuantizedModule:
        """Rebuild a module from ``layout()`` and its buffers (e.g. read back from a file)."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        for name in cls.LAYOUT_FIELDS:
            value = layout[name] if name in layout else cls.LAYOUT_DEFAULTS[name]
            if name == "out_dtype":
                value = getattr(torch, value)
            setattr(mod, name, value)
        for name in cls.BUFFER_NAMES:
            mod.register_buffer(name, tensors.get(name))
        mod._post_load()
        return mod

    def _post_load(self) -> None:
        """Derive shape attributes from the buffers after ``from_layout``."""

    @property
    def input_quantized(self) -> bool:
        """True when the layer expects int8/fp8 input handed over by the previous fused layer."""
        return self._input_quantized

    def facing_weight(self) -> torch.Tensor:
        """What a swapped layer shows its parent as ``weight`` (``convert(output="model")``): an
        empty tensor of the float dtype the layer computes in, on the layer's device. Models
        cast inputs to ``layer.weight.dtype`` (ViT's patch embedding); an int8 ``weight`` there
        would turn the input into integers before the layer sees it."""
        dtype = self.out_dtype if self.out_dtype.is_floating_point else torch.float32
        if dtype == torch.float8_e4m3fn:
            dtype = torch.float32
        return torch.empty(0, dtype=dtype, device=self._buffers["weight"].device)

    @property
    def output_quantized(self) -> bool:
        """True when the layer hands int8/fp8 to the next fused layer."""
        return self.out_dtype in (torch.int8, torch.float8_e4m3fn)
