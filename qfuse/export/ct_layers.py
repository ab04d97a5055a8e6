"""Which ``nn.Linear`` of the user's model each fused qfuse layer computes, and that Linear's
tensors as compressed-tensors stores them.

A converted model holds fused modules where the float model had Linears, sometimes several in
one: prepare merges Q/K/V (rows concatenated, ``attention.self.query_key_value``) and a gated
MLP's gate/up (rows interleaved, ``mlp.gate_proj_up_proj``); ``convert(output="model")`` keeps
them merged behind ``QSibling`` members or a whole ``QGatedMLP``. A serving engine reads one
tensor set per Linear of the model's own layout, so each Linear is a ``Slot``: the name, the
fused module and the rows of it that are this Linear.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from qfuse.errors import FormatError, UnsupportedError
from qfuse.export.ct_scheme import Scheme
from qfuse.fusion.patterns import GATED
from qfuse.fusion.siblings import merged_path
from qfuse.nn.base import QuantizedModule
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.nn.qlinear import QLinear
from qfuse.nn.siblings import QSibling


@dataclass(frozen=True)
class Slot:
    """Linear ``name`` of the float model is rows ``rows`` of the fused ``module``."""

    name: str
    module: QLinear
    rows: slice


def _linear(template: nn.Module, name: str) -> nn.Linear:
    try:
        module = template.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Linear):
        found = type(module).__name__ if module is not None else "nothing"
        raise UnsupportedError(
            f"layer {name}: compressed-tensors quantizes nn.Linear layers, and the model has "
            f"{found} there (a Conv1D, a conv, or a GEMM outside a module). Keep it float "
            "(qfuse.convert(..., keep_float={...})) to export, or ship it with qfuse.save."
        )
    return module


def _members(template: nn.Module, name: str, module: QLinear, members: list[str]):
    """Slots of a merged layer: interleaved rows for a gate/up pair, consecutive for Q/K/V."""
    if module.activation in GATED:
        for i, member in enumerate(members):
            yield Slot(member, module, slice(i, None, len(members)))
        return
    start = 0
    for member in members:
        rows = _linear(template, member).weight.shape[0]
        yield Slot(member, module, slice(start, start + rows))
        start += rows
    if start != module.weight.shape[0]:
        raise FormatError(
            f"layer {name}: the merged layer has {module.weight.shape[0]} rows, its members "
            f"{members} {start} in the float model. Pass the float model it was converted from."
        )


def _check(slot: Slot, template: nn.Module) -> Slot:
    if not isinstance(slot.module, QLinear):
        raise UnsupportedError(
            f"layer {slot.name} is a quantized {type(slot.module).__name__}: compressed-tensors "
            "describes quantized nn.Linear layers only. Keep it float to export (keep_float), "
            "or ship the model with qfuse.save / ONNX."
        )
    want = tuple(_linear(template, slot.name).weight.shape)
    got = tuple(slot.module._buffers["weight"][slot.rows].shape)
    if want != got:
        raise FormatError(
            f"layer {slot.name}: the quantized weight is {got}, the float model's Linear {want}. "
            "Pass the float model the quantized one was converted from."
        )
    return slot


def graph_slots(gm: nn.Module, state, template: nn.Module) -> list[Slot]:
    """The slots of a converted graph (``qfuse.convert`` / ``qfuse.load``)."""
    groups = {merged_path(g): list(g) for g in state.merged}
    slots = []
    for record in state.layers:
        module = gm.get_submodule(record.name)
        if record.name in groups and isinstance(module, QLinear):
            slots.extend(_members(template, record.name, module, groups[record.name]))
        else:
            slots.append(Slot(record.name, module, slice(None)))
    return [_check(s, template) for s in slots]


def _gated_slots(name: str, mlp: QGatedMLP, state, template: nn.Module) -> Iterator[Slot]:
    pair = next(
        (g for g in state.merged if len(g) == 2 and all(m.rpartition(".")[0] == name for m in g)),
        None,
    )
    if pair is None:
        raise FormatError(f"{name}: a swapped gated MLP without its merged gate/up record.")
    yield from _members(template, f"{name}.gate_up", mlp.gate_up, list(pair))
    parent = template.get_submodule(name)
    rest = [
        f"{name}.{n}"
        for n, m in parent.named_children()
        if isinstance(m, nn.Linear) and f"{name}.{n}" not in pair
    ]
    if len(rest) != 1:
        raise FormatError(
            f"{name}: the float model's MLP has Linears {rest} besides gate/up {pair}; "
            "expected one down projection."
        )
    yield Slot(rest[0], mlp.down, slice(None))


def model_slots(model: nn.Module, state, template: nn.Module) -> list[Slot]:
    """The slots of a model returned by ``qfuse.convert(..., output="model")``."""
    return [_check(s, template) for s in quantized_slots(model, state, template)]


def quantized_slots(model: nn.Module, state, template: nn.Module) -> list[Slot]:
    """Every quantized layer of an ``output="model"`` model, merged ones split back into the
    float model's layers, unchecked."""
    slots, inside = [], ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if isinstance(module, QGatedMLP):
            slots.extend(_gated_slots(name, module, state, template))
        elif isinstance(module, QSibling):
            slots.append(Slot(name, module.merged_layer, slice(module.start, module.end)))
        elif isinstance(module, QuantizedModule):
            slots.append(Slot(name, module, slice(None)))
        else:
            continue
        inside = (*inside, f"{name}.")  # its children are the merged layers just listed
    return slots


# The tensors of one Linear -------------------------------------------------------------------
@dataclass
class CTLinear:
    """One quantized Linear as compressed-tensors stores it."""

    scheme: Scheme
    weight: torch.Tensor  # int8 / float8_e4m3fn [out, in]
    weight_scale: torch.Tensor  # float32 [out, 1]
    input_scale: torch.Tensor | None  # float32 [1] (static)
    input_zero_point: torch.Tensor | None  # int8 [1] (asymmetric)
    bias: torch.Tensor | None  # float32 [out]

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        out = {
            "weight": self.weight,
            "weight_scale": self.weight_scale,
            "input_scale": self.input_scale,
            "input_zero_point": self.input_zero_point,
            "bias": self.bias,
        }
        return {
            f"{name}.{k}": v.detach().cpu().contiguous() for k, v in out.items() if v is not None
        }


def _unfold_bias(folded, codes, zero_point, scale, has_bias: bool, name: str) -> torch.Tensor:
    """The bias before ``QLinear`` folded the input zero point's correction into it.

    The fold stored ``float32(b - zp * colsum(W) * scale)`` (float64 inside). Without a float
    bias, ``b`` was 0 and must fold to the stored value; otherwise this finds a float32 ``b`` that
    folds back to exactly the stored value (the original, or a neighbour folding to the same
    number), so the re-imported layer runs bit for bit as this one."""
    corr = zero_point.double() * codes.to(torch.int32).sum(1).double() * scale.double()
    first = torch.zeros_like(folded) if not has_bias else (folded.double() + corr).float()
    out, todo = first.clone(), torch.ones_like(first, dtype=torch.bool)
    for step in (0, 1, -1, 2, -2) if has_bias else (0,):
        cand = first
        for _ in range(abs(step)):
            cand = torch.nextafter(
                cand, torch.full_like(cand, float("inf") if step > 0 else float("-inf"))
            )
        ok = todo & ((cand.double() - corr).float() == folded)
        out, todo = torch.where(ok, cand, out), todo & ~ok
    if todo.any():
        raise FormatError(
            f"layer {name}: the bias with the zero-point correction folded in cannot be unfolded "
            "exactly; the layer's buffers are inconsistent. Re-convert the model."
        )
    return out


def ct_linear(slot: Slot, has_bias: bool, asymmetric: bool = False) -> CTLinear:
    """Slot ``slot`` of a fused layer as compressed-tensors' tensors; ``has_bias``: whether the
    float model's Linear has a bias (a merged layer holds zeros for members without one);
    ``asymmetric``: the model's int8 activations have zero points (a layer whose zero point
    came out 0 keeps none in qfuse, and gets an explicit 0 here, in its peers' group)."""
    b, rows = slot.module._buffers, slot.rows
    inv = b["x_inv_scale"]
    if inv is not None and inv.numel() != 1:
        raise UnsupportedError(
            f"layer {slot.name}: SmoothQuant scales its input per channel in the GEMM's prologue "
            "(its producer could not absorb the factors); compressed-tensors has one input scale "
            "per layer. Convert without SmoothQuant for this layer, or ship with qfuse.save."
        )
    codes = b["weight"][rows]
    zp = b["x_zero_point"]
    dynamic = b["x_scale"] is None
    if zp is None and asymmetric and not dynamic and codes.dtype == torch.int8:
        zp = torch.zeros((), dtype=torch.int32)
    scheme = Scheme(codes.dtype, dynamic=dynamic, symmetric=zp is None)
    bias = b["bias"][rows] if b["bias"] is not None else None
    folded = bias is not None and zp is not None and bool(zp.any())
    if folded:
        bias = _unfold_bias(bias, codes, zp, b["scale"][rows], has_bias, slot.name)
    if not has_bias:
        if bias is not None and bias.any():
            raise FormatError(
                f"layer {slot.name}: the quantized layer has a non-zero bias, the float model's "
                "Linear none. Pass the float model the quantized one was converted from."
            )
        bias = None
    return CTLinear(
        scheme=scheme,
        weight=codes,
        weight_scale=b["weight_scale"][rows].float().reshape(-1, 1),
        input_scale=None if dynamic else b["x_scale"].float().reshape(1),
        input_zero_point=zp.to(torch.int8).reshape(1) if zp is not None else None,
        bias=bias.float() if bias is not None else None,
    )
