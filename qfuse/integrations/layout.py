"""The modules ``convert(output="model")`` swapped into a user's model, as JSON and back.

``describe`` walks a converted model and writes, per swapped module path, what was put there
(``QLinear`` / ``QLinear4`` / ``QConv2d`` with their ``layout()`` and buffer shapes, a
``QSibling`` member and the member holding the merged GEMM, a whole ``QGatedMLP``, a
``QConv1d``, a folded BatchNorm's ``Identity``). ``rebuild`` puts the same modules, with empty
buffers of the recorded shapes and dtypes, into a freshly built float model of the same class
(transformers builds it on the meta device), so that a state dict saved from the converted model
loads into it name for name; ``finish`` then repacks the loaded buffers and turns the swapped
layers back to float-facing.

Nothing here depends on transformers: ``qfuse.integrations.transformers`` drives it from
``save_pretrained`` / ``from_pretrained``.
"""

from __future__ import annotations

import torch
from torch import nn

from qfuse.errors import FormatError, UnsupportedError
from qfuse.flows.swap import copy_public_attrs, float_facing, is_float_facing, keep_float_attrs
from qfuse.nn import QConv2d, QLinear
from qfuse.nn.base import QuantizedModule
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.nn.qconv1d import QConv1d
from qfuse.nn.qlinear4 import QLinear4
from qfuse.nn.siblings import QSibling
from qfuse.state import get_state

LAYOUT_VERSION = 1
# A 4-bit layer's layout holds in_features, group_size and act_bits, its buffers the packed
# codes, group scales, zero points (asymmetric) and a W4A8 layer's static input scale.
_QUANTIZED = {"QLinear": QLinear, "QLinear4": QLinear4, "QConv2d": QConv2d}


def _quantized_entry(module: QuantizedModule, path: str) -> dict:
    names = [name for name, cls in _QUANTIZED.items() if isinstance(module, cls)]
    if not names:
        raise UnsupportedError(
            f"save_pretrained: {path} is a {type(module).__name__}, which the qfuse transformers "
            "integration does not save yet; use qfuse.save on the graph model (output='graph')."
        )
    tensors = {
        k: [str(v.dtype).replace("torch.", ""), list(v.shape)]
        for k, v in module._buffers.items()
        if v is not None
    }
    return {
        "module": names[0],
        "facing": is_float_facing(module),
        "layout": module.layout(),
        "tensors": tensors,
    }


def _folded_batchnorms(model: nn.Module) -> set[str]:
    state = get_state(model)
    names = state.folded_batchnorms if state is not None else []
    return {n[: -len(".weight")] for n in names if n.endswith(".weight")}


def describe(model: nn.Module) -> dict[str, dict]:
    """Swapped module path -> what to build there (JSON-able), in ``named_modules`` order.

    Raises ``UnsupportedError`` naming the module when a qfuse module is one this format cannot
    describe (the caller refuses to write a file that would load broken).
    """
    paths = {id(m): p for p, m in model.named_modules()}
    folded = _folded_batchnorms(model)
    out: dict[str, dict] = {}
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in out):
            continue  # inside a module already described (QSibling.merged, QGatedMLP.down, ...)
        if isinstance(module, QSibling):
            owner = paths.get(id(module.owner))
            if owner is None:
                raise UnsupportedError(
                    f"save_pretrained: {path} is a QSibling whose merged GEMM lives outside the "
                    "model; convert the model again with qfuse.convert(..., output='model')."
                )
            entry = {"module": "QSibling", "owner": owner, "index": module.index,
                     "start": module.start, "end": module.end, "members": module.members}
            if owner == path:
                entry["merged"] = _quantized_entry(module.merged, f"{path}.merged")
            out[path] = entry
        elif isinstance(module, QGatedMLP):
            out[path] = {"module": "QGatedMLP",
                         "gate_up": _quantized_entry(module.gate_up, f"{path}.gate_up"),
                         "down": _quantized_entry(module.down, f"{path}.down")}
        elif isinstance(module, QConv1d):
            out[path] = {"module": "QConv1d", "conv": _quantized_entry(module.conv, f"{path}.conv")}
        elif isinstance(module, QuantizedModule):
            out[path] = _quantized_entry(module, path)
        elif isinstance(module, nn.Identity) and path in folded:
            out[path] = {"module": "Identity"}
        elif type(module).__module__.startswith("qfuse.") and path:
            raise UnsupportedError(
                f"save_pretrained: {path} is a {type(module).__name__}, which the qfuse "
                "transformers integration does not save yet; use qfuse.save on the graph model "
                "(output='graph')."
            )
    return out


def _empty(entry: dict, path: str) -> QuantizedModule:
    """A module of the recorded class and layout, buffers empty (on the default device)."""
    cls = _QUANTIZED.get(entry.get("module"))
    if cls is None:
        raise FormatError(f"{path}: unknown qfuse module {entry.get('module')!r} in "
                          "quantization_config; upgrade qfuse to load this model.")
    tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype))
               for name, (dtype, shape) in entry["tensors"].items()}
    return cls.from_layout(entry["layout"], tensors)


def _float_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise FormatError(
            f"quantization_config names the swapped module {path}, which the model "
            f"{type(model).__name__} built from config.json does not have; load it with the "
            "model class it was saved from."
        ) from exc


def rebuild(model: nn.Module, modules: dict[str, dict]) -> None:
    """Replace each described path of the float ``model`` by its qfuse module with empty
    buffers (plain, not float-facing, so loaders see the quantized buffers by name)."""
    built: dict[str, QSibling] = {}
    owners_first = sorted(modules.items(), key=lambda kv: kv[1].get("owner", kv[0]) != kv[0])
    for path, entry in owners_first:
        float_module = _float_module(model, path)
        kind = entry.get("module")
        if kind == "Identity":
            new = nn.Identity()
        elif kind == "QSibling":
            owner = built.get(entry["owner"])
            if entry["owner"] == path:
                merged = _empty(entry["merged"], f"{path}.merged")
                new = QSibling(None, merged, entry["index"], entry["start"], entry["end"],
                               entry["members"])
            elif owner is None:
                raise FormatError(f"{path}: its merged layer {entry['owner']} is not in "
                                  "quantization_config; the file is damaged, save it again.")
            else:
                new = QSibling(owner, owner.merged, entry["index"], entry["start"],
                               entry["end"], entry["members"])
            built[path] = new
        elif kind == "QGatedMLP":
            new = QGatedMLP(_empty(entry["gate_up"], f"{path}.gate_up"),
                            _empty(entry["down"], f"{path}.down"))
            copy_public_attrs(float_module, new)
        elif kind == "QConv1d":
            new = QConv1d(_empty(entry["conv"], f"{path}.conv"))
        else:
            new = _empty(entry, path)
        model.set_submodule(path, keep_float_attrs(float_module, new))


def finish(model: nn.Module, modules: dict[str, dict]) -> None:
    """After the buffers are loaded: derive what each module computes from them (packed conv
    weights, shapes) and make the swapped layers face their parents as float again."""
    for path, entry in modules.items():
        module = model.get_submodule(path)
        inner = {"QSibling": "merged", "QConv1d": "conv"}.get(entry["module"])
        parts = [(module, entry)]
        if entry["module"] == "QGatedMLP":
            parts = [(module.gate_up, entry["gate_up"]), (module.down, entry["down"])]
        elif inner and inner in entry:
            parts = [(getattr(module, inner), entry[inner])]
        for part, spec in parts:
            if isinstance(part, QuantizedModule):
                part._post_load()
                if spec.get("facing"):
                    float_facing(part)
