"""The compressed-tensors ``quantization_config``: qfuse's W8A8 schemes as the format's JSON, and
the format's JSON back to a scheme qfuse runs (or a ``UnsupportedError`` naming what it is).

compressed-tensors (the format llm-compressor writes; transformers' ``CompressedTensorsHfQuantizer``
and vLLM / SGLang read it) describes a checkpoint in ``config.json``'s ``quantization_config``:
``config_groups`` of ``{targets, weights, input_activations}`` argument sets, a global ``format``
naming how the weights are stored, and an ``ignore`` list of layers left in float. qfuse's schemes
map onto it exactly:

================================  =======================================================
qfuse                             compressed-tensors
================================  =======================================================
int8 weights [-127, 127], one     ``weights: {num_bits: 8, type: int, strategy: channel,
scale per output channel          symmetric: true}``, ``weight`` int8, ``weight_scale``
                                  float32 ``[out, 1]`` (per-tensor weights: the one scale
                                  repeated per channel, which is what qfuse stores too)
fp8 e4m3 weights, per channel     the same with ``type: float``, ``weight`` float8_e4m3fn
static per-tensor activations     ``input_activations: {strategy: tensor, dynamic: false}``,
                                  ``input_scale`` float32 ``[1]``; asymmetric int8 adds
                                  ``symmetric: false`` and ``input_zero_point`` int8 ``[1]``
dynamic per-token activations     ``{strategy: token, dynamic: true}``: no stored scale
================================  =======================================================

Both quantize activations with ``scale = amax / 127.5`` (int8) or ``amax / 448`` (fp8) per token.
What differs is arithmetic, not the scheme: compressed-tensors rounds ``x / scale`` where qfuse
rounds ``x * (1 / scale)`` (a value within an ulp of a rounding boundary can land one code apart),
and qfuse's fused hand-offs (a LayerNorm or an epilogue writing int8 for the next layer) are, in
the format, the float tensor quantized by the reader with the same ``input_scale``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from qfuse.errors import FormatError, UnsupportedError

QUANT_METHOD = "compressed-tensors"
# The compressed-tensors release whose checkpoint layout this module writes and reads.
FORMAT_VERSION = "0.20.0"
INT_FORMAT, FLOAT_FORMAT, MIXED_FORMAT = "int-quantized", "float-quantized", "mixed-precision"
# Formats that store W8A8 weights as plain int8 / fp8 tensors (``naive-quantized`` is the
# generic name of the same layout).
_PLAIN_FORMATS = (INT_FORMAT, FLOAT_FORMAT, "naive-quantized")
_TYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Scheme:
    """One W8A8 scheme qfuse runs: weight/activation dtype, activation scales static per-tensor
    (``dynamic=False``) or per-token at run time, activation zero point or not.

    Example:
        >>> s = Scheme(torch.int8, dynamic=False, symmetric=False)
        >>> s.format, s.input_args()["strategy"], s.input_args()["symmetric"]
        ('int-quantized', 'tensor', False)
        >>> s.describe()
        'int8 W8A8 (per-channel weights, static per-tensor asymmetric activations)'
    """

    dtype: torch.dtype
    dynamic: bool
    symmetric: bool = True

    @property
    def type(self) -> str:
        return "float" if self.dtype == torch.float8_e4m3fn else "int"

    @property
    def format(self) -> str:
        return FLOAT_FORMAT if self.type == "float" else INT_FORMAT

    def weight_args(self) -> dict:
        return _args(self.type, "channel", symmetric=True, dynamic=False)

    def input_args(self) -> dict:
        if self.dynamic:
            return _args(self.type, "token", symmetric=self.symmetric, dynamic=True)
        return _args(self.type, "tensor", symmetric=self.symmetric, dynamic=False)

    def group(self, targets: list[str]) -> dict:
        """One ``config_groups`` entry."""
        return {
            "targets": list(targets),
            "weights": self.weight_args(),
            "input_activations": self.input_args(),
            "output_activations": None,
            "format": self.format,
        }

    def describe(self) -> str:
        kind = "fp8 e4m3" if self.type == "float" else "int8"
        acts = "dynamic per-token" if self.dynamic else "static per-tensor"
        zp = "" if self.symmetric else " asymmetric"
        return f"{kind} W8A8 (per-channel weights, {acts}{zp} activations)"


def _args(type_: str, strategy: str, *, symmetric: bool, dynamic: bool) -> dict:
    return {
        "num_bits": 8,
        "type": type_,
        "symmetric": symmetric,
        "group_size": None,
        "strategy": strategy,
        "dynamic": dynamic,
    }


def quantization_config(groups: dict[Scheme, list[str]], ignore: list[str], by_class: bool) -> dict:
    """The ``quantization_config`` of ``config.json`` for layers quantized as ``groups``.

    ``by_class``: one scheme for every quantized layer, which are all ``nn.Linear``: the group
    targets the class ``Linear`` and ``ignore`` names the Linears left in float (the layout
    llm-compressor writes). Otherwise each group lists its layers by name.
    """
    schemes = sorted(groups, key=lambda s: (s.type, s.dynamic, s.symmetric))
    config_groups = {
        f"group_{i}": s.group(["Linear"] if by_class else sorted(groups[s]))
        for i, s in enumerate(schemes)
    }
    formats = {s.format for s in schemes}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else MIXED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": FORMAT_VERSION,
    }


# Reading --------------------------------------------------------------------------------------
def describe_args(args: dict | None) -> str:
    """``int4 group(128) asymmetric`` for a weights / activations argument set."""
    if not args:
        return "none"
    type_ = "fp" if args.get("type") == "float" else "int"
    strategy = args.get("strategy") or ("group" if args.get("group_size") else "tensor")
    if strategy == "group":
        strategy = f"group({args.get('group_size')})"
    if strategy == "block":
        strategy = f"block({args.get('block_structure')})"
    dynamic = " dynamic" if args.get("dynamic") else ""
    sym = "" if args.get("symmetric", True) else " asymmetric"
    return f"{type_}{args.get('num_bits', 8)} {strategy}{dynamic}{sym}"


_RUNS = (
    "qfuse runs W8A8 only: int8 or fp8 e4m3 weights, symmetric, per channel or per tensor, with "
    "activations of the same type quantized static per-tensor (int8 may be asymmetric) or "
    "dynamic per-token (symmetric)"
)


def scheme_of(name: str, group: dict, path: str) -> Scheme:
    """The ``Scheme`` of config group ``name``; ``UnsupportedError`` naming the group's scheme
    (W4A16, group-wise, block fp8, ...) when qfuse cannot run it."""
    weights, inputs = group.get("weights"), group.get("input_activations")
    short = f"W{(weights or {}).get('num_bits', 16)}A{(inputs or {}).get('num_bits', 16)}"
    what = f"{short}: weights {describe_args(weights)}, input activations {describe_args(inputs)}"

    def refuse(why: str):
        return UnsupportedError(
            f"{path}: config group {name!r} ({what}) cannot run on qfuse's kernels: {why}. "
            f"{_RUNS}. Serve this checkpoint with vLLM or transformers, or quantize the float "
            "model with qfuse."
        )

    if group.get("output_activations"):
        raise refuse("it quantizes output activations")
    if not weights or weights.get("num_bits") != 8 or weights.get("type") not in _TYPES:
        bits = (weights or {}).get("num_bits")
        raise refuse(f"its weights are {bits}-bit" if weights else "its weights are not quantized")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise refuse("its weights have zero points or dynamic scales")
    if (
        weights.get("strategy") not in ("channel", "tensor")
        or weights.get("group_size") not in (None, -1)
        or weights.get("block_structure")
    ):
        raise refuse("its weight scales are group- or block-wise")
    if not inputs:
        raise refuse("it is weight-only (activations stay 16-bit); qfuse quantizes them too")
    if inputs.get("num_bits") != 8 or inputs.get("type") != weights.get("type"):
        raise refuse("its activations are not 8-bit of the weights' type")
    dynamic, strategy = inputs.get("dynamic"), inputs.get("strategy")
    symmetric = bool(inputs.get("symmetric", True))
    if dynamic is True and strategy == "token":
        if not symmetric:
            raise refuse("its dynamic per-token activations are asymmetric")
    elif not (dynamic is False and strategy == "tensor"):
        raise refuse(f"its activations are {strategy} with dynamic={dynamic}")
    if not symmetric and weights["type"] == "float":
        raise refuse("its fp8 activations are asymmetric")
    return Scheme(_TYPES[weights["type"]], dynamic=bool(dynamic), symmetric=symmetric)


def read_groups(qc: dict, path: str) -> dict[str, tuple[Scheme, list[str]]]:
    """``{group name: (Scheme, targets)}`` of a ``quantization_config``, after checking that the
    rest of it (method, format, KV cache, sparsity, transforms) is something qfuse runs."""
    if qc.get("quant_method") != QUANT_METHOD:
        raise FormatError(
            f"{path}: quantization_config has quant_method {qc.get('quant_method')!r}, not "
            f"{QUANT_METHOD!r}: this is not a compressed-tensors checkpoint."
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise FormatError(f"{path}: quantization_config has no config_groups; nothing to load.")
    schemes = {
        name: (scheme_of(name, g, path), list(g.get("targets") or [])) for name, g in groups.items()
    }
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if g.get("format")}
    odd = sorted(str(f) for f in formats - {MIXED_FORMAT} if f not in _PLAIN_FORMATS)
    if odd:
        raise UnsupportedError(
            f"{path}: weights stored as {odd}; qfuse reads W8A8 checkpoints stored as "
            f"{' / '.join(_PLAIN_FORMATS)} (plain int8 / fp8 weight tensors)."
        )
    for key, what in (
        ("kv_cache_scheme", "a quantized KV cache"),
        ("sparsity_config", "sparse weights"),
        ("transform_config", "transforms"),
    ):
        if qc.get(key):
            raise UnsupportedError(
                f"{path}: the checkpoint uses {what} ({key}); qfuse's fused layers do not "
                "implement it. Serve it with vLLM."
            )
    return schemes


def matches(name: str, module, target: str) -> bool:
    """compressed-tensors' matching rule: ``re:<regex>`` matches the layer name from its start,
    any other target is a layer name or a class name in the module's MRO.

    Example:
        >>> from torch import nn
        >>> matches("model.layers.0.mlp.up_proj", nn.Linear(2, 2), "Linear")
        True
        >>> matches("model.layers.0.mlp.up_proj", nn.Linear(2, 2), "re:.*mlp.*")
        True
    """
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(cls.__name__ == target for cls in type(module).__mro__)
