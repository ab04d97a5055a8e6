"""The fused GEMM's call, described once: ``GemmCall``.

A quantized Linear calls the GEMM with the same weight, scales, bias, zero points, activation and
output dtype every time; only the input ``x`` (with its per-token scales ``x_scale`` when it comes
quantized) and the ``residual`` change. ``GemmCall`` holds the first kind, built once per layer
(``nn.QLinear``); every reader takes it with the per-call tensors beside it, as
``(x, call, x_scale, residual)``: the kernel families' arguments (``launch.gemm_args``), the eager
cached launches (``eager``), the schedule choice (``dispatch``), the traced op's body
(``ops.qlinear``) and the CPU reference (``ops.reference.qlinear``).

The flat argument list stays only where ``torch.library`` needs tensors as separate arguments:
the ``qfuse::qlinear`` and ``qfuse::qlinear_launch`` schemas. ``OpArgs`` writes such a list once,
argument by argument; ``op_args`` flattens a call into it and ``from_op_args`` builds it back.

Example:
    >>> import torch
    >>> call = GemmCall(torch.ones(4, 8, dtype=torch.int8), torch.ones(4), act="swiglu")
    >>> call.out_features
    2
    >>> x = torch.ones(3, 8)
    >>> flat = call.op_args(x)
    >>> len(flat), flat[10], flat[11]
    (14, 'swiglu', torch.float32)
    >>> x2, again, x_scale, residual = GemmCall.from_op_args(*flat)
    >>> x2 is x and again.weight is call.weight and again.act == "swiglu"
    True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import ClassVar

import torch

from qfuse.kernels.common import out_features

_REQUIRED = inspect.Parameter.empty
# Schema types of the annotations ``torch.library`` infers them from.
_ANNOTATIONS = {
    "Tensor": torch.Tensor,
    "Tensor?": torch.Tensor | None,
    "str": str,
    "ScalarType": torch.dtype,
    "bool": bool,
    "SymInt": int,
    "SymInt[]": list[int],
}


@dataclasses.dataclass(frozen=True)
class OpArg:
    """One argument of a custom op's schema: its name, schema type and default (``_REQUIRED``:
    none), and the call description's field it carries (None: a per-call argument)."""

    name: str
    type: str
    default: object = _REQUIRED
    field: str | None = None


class OpArgs:
    """A custom op's flat argument list for a frozen call description ``kind``: the op's
    Python signature (``signature``: ``torch.library`` infers the schema from it), a call
    flattened into it (``flatten``) and built back (``unflatten``)."""

    def __init__(self, kind: type, args: tuple[OpArg, ...]) -> None:
        self.kind, self.args = kind, args
        self.fields = tuple(a for a in args if a.field is not None)
        self.per_call = tuple(a.name for a in args if a.field is None)

    def signature(self, *extra: OpArg, defaults: bool = True) -> inspect.Signature:
        """The op's signature, ``extra`` arguments appended; ``defaults=False`` drops the
        defaults (an op whose extra arguments follow the defaulted ones)."""
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature(
            [inspect.Parameter(a.name, kind, annotation=_ANNOTATIONS[a.type],
                               default=a.default if defaults else _REQUIRED)
             for a in (*self.args, *extra)],
            return_annotation=torch.Tensor,
        )

    def flatten(self, call, per_call: dict) -> tuple:
        """``call``'s fields and the ``per_call`` arguments (by the op's names; they override
        a field of that name) in the op's order."""
        return tuple(per_call.get(a.name) if a.field is None or a.name in per_call
                     else getattr(call, a.field) for a in self.args)

    def unflatten(self, args: tuple, kwargs: dict) -> tuple:
        """``(call, per-call arguments in the op's order)`` from an op's arguments as it was
        called: positional, by name, or left out where they have defaults."""
        values = {}
        for i, a in enumerate(self.args):
            if i < len(args):
                values[a.name] = args[i]
            elif a.name in kwargs:
                values[a.name] = kwargs[a.name]
            elif a.default is not _REQUIRED:
                values[a.name] = a.default
            else:
                raise TypeError(f"missing argument {a.name!r}")
        call = self.kind(**{a.field: values[a.name] for a in self.fields})
        return call, tuple(values[name] for name in self.per_call)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedCall:
    """What the fused ops' call descriptions share (``GemmCall``, ``conv.call.ConvCall``), and
    what the reference epilogue reads: the quantized ``weight``; ``scale`` [N], per output
    channel: ``s_x * s_w`` (static) or ``s_w`` (dynamic); ``bias`` [N]; ``x_inv_scale`` and
    ``x_zero_point`` (int8 only): a float input's static quantization, None for a dynamic or an
    already quantized input; ``out_inv_scale`` / ``out_zero_point``: an int8/fp8 output's
    static requantization; ``act``: the epilogue activation (``common.EPILOGUE_ACTIVATIONS``);
    ``out_dtype``. Frozen and compared by identity: it holds a layer's tensors."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None
    x_inv_scale: torch.Tensor | None = None
    x_zero_point: torch.Tensor | None = None
    out_inv_scale: torch.Tensor | None = None
    out_zero_point: torch.Tensor | None = None
    act: str = "none"
    out_dtype: torch.dtype = torch.float32


@dataclasses.dataclass(frozen=True, eq=False)
class GemmCall(QuantizedCall):
    """What one layer's fused GEMM calls are made of, besides ``x``, ``x_scale`` and ``residual``.

    ``weight`` int8 or fp8 [N, K]; ``x_inv_scale`` a scalar, or [K] per input channel
    (SmoothQuant's prologue); with ``x_zero_point``, ``weight_sum`` (int32 [N],
    ``sum_k W[n, k]``) corrects the accumulator by ``- x_zero_point * weight_sum`` (None where
    the correction is folded into ``bias``); ``fast_act``: GELU/SiLU on the GPU's approximate
    erf/exp (the CPU reference is exact either way). The rest as ``QuantizedCall``.
    """

    weight_sum: torch.Tensor | None = None
    fast_act: bool = False
    # Nothing runs after a GEMM's residual add (a conv's ``post_act``): the shared reference
    # epilogue reads it from either description.
    post_act: ClassVar[str] = "none"

    @property
    def out_features(self) -> int:
        """Output columns: the weight's rows, halved by a gated activation."""
        return out_features(self.weight.shape[0], self.act)

    @functools.cached_property
    def pointers(self) -> tuple:
        """The kernels' per-layer pointer arguments, an absent tensor replaced by a never-read
        dummy (``scale``): weight, scale, bias, x_inv_scale, x_zero_point, weight_sum,
        out_inv_scale, out_zero_point. Computed once per call description."""
        d = self.scale
        opt = lambda t: t if t is not None else d  # noqa: E731
        return (self.weight, self.scale, opt(self.bias), opt(self.x_inv_scale),
                opt(self.x_zero_point), opt(self.weight_sum), opt(self.out_inv_scale),
                opt(self.out_zero_point))

    @functools.cached_property
    def variant(self) -> tuple:
        """Everything of this call a compiled kernel is specialized on besides the weight's
        shape and dtype (which a layer fixes): the eager plans' key, with x's."""
        return (self.act, self.out_dtype, self.fast_act,
                self.x_inv_scale is None or self.x_inv_scale.numel(),
                self.x_zero_point is None, self.bias is None, self.out_zero_point is None)

    def op_args(self, x: torch.Tensor, x_scale: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple:
        """The ``qfuse::qlinear`` op's flat arguments for this call."""
        return OP_ARGS.flatten(self, {"x": x, "x_scale": x_scale, "residual": residual})

    @staticmethod
    def from_op_args(*args, **kwargs) -> tuple:
        """``(x, call, x_scale, residual)`` from ``qfuse::qlinear``'s arguments."""
        call, (x, residual, x_scale) = OP_ARGS.unflatten(args, kwargs)
        return x, call, x_scale, residual


# The fused ops' schemas share how they name an input and an output's quantization (the conv's
# is ``conv.call.OP_ARGS``).
INPUT_ARGS = (
    OpArg("x", "Tensor"),
    OpArg("weight", "Tensor", field="weight"),
    OpArg("scale", "Tensor", field="scale"),
    OpArg("bias", "Tensor?", field="bias"),
    OpArg("x_inv_scale", "Tensor?", field="x_inv_scale"),
    OpArg("x_zero_point", "Tensor?", field="x_zero_point"),
)
OUTPUT_ARGS = (
    OpArg("out_inv_scale", "Tensor?", field="out_inv_scale"),
    OpArg("out_zero_point", "Tensor?", field="out_zero_point"),
    OpArg("activation", "str", field="act"),
    OpArg("out_dtype", "ScalarType", field="out_dtype"),
)
# ``qfuse::qlinear``'s schema, argument by argument (``qfuse::qlinear_launch`` appends its
# schedule), in the order ops.qlinear has always taken them.
OP_ARGS = OpArgs(GemmCall, (
    *INPUT_ARGS,
    OpArg("weight_sum", "Tensor?", field="weight_sum"),
    OpArg("residual", "Tensor?"),
    *OUTPUT_ARGS,
    OpArg("x_scale", "Tensor?", None),
    OpArg("fast_act", "bool", False, field="fast_act"),
))


def fake_output(*args, **kwargs) -> torch.Tensor:
    """The output a ``qfuse::qlinear``-shaped op returns, from its arguments' shapes alone (its
    fake tensor): ``[..., out_features]`` of the call's ``out_dtype``."""
    x, call, _, _ = GemmCall.from_op_args(*args, **kwargs)
    return x.new_empty((*x.shape[:-1], call.out_features), dtype=call.out_dtype)
