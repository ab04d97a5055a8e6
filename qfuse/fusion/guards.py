"""Run-time guards of a converted graph, added by ``convert`` and ``load``: each input's dtype
and device checked against what the model was built for (a ``QFuseError`` naming the input and
the fix, where the fused ops would quantize an int64 batch or fail inside torch), then the NaN
and Inf marks of ``fusion.nonfinite``."""

from __future__ import annotations

import torch
from torch import fx, nn

from qfuse.errors import DeviceError, ShapeError, UnsupportedError
from qfuse.fusion.nonfinite import guard_graph, guard_model
from qfuse.nn.base import QuantizedModule


def check_input(x, what: str, dtype: torch.dtype | None, ref: torch.Tensor):
    """Raise unless ``x`` (``what``: "input 'x'") is on ``ref``'s device and of the dtype the
    model was captured with (``dtype``; None: any float, a swapped layer's input). Returns
    ``x`` (a pass-through node in the graph).

    Example:
        >>> w = torch.zeros(1)
        >>> check_input(torch.ones(2), "input 'x'", torch.float32, w).shape
        torch.Size([2])
        >>> check_input(torch.ones(2, dtype=torch.int64), "input 'x'", torch.float32, w)
        Traceback (most recent call last):
        ...
        qfuse.errors.UnsupportedError: input 'x' is torch.int64; ...
    """
    if not isinstance(x, torch.Tensor):
        return x
    if x.device != ref.device:
        where = "holds no data" if x.device.type == "meta" else f"is on {x.device}"
        raise DeviceError(f"{what} {where}, the model is on {ref.device}: pass the input "
                          f"on {ref.device} (x.to('{ref.device}')), or move the model with "
                          ".to(device).")
    floating = x.is_floating_point() and x.dtype != torch.float8_e4m3fn
    if dtype is None and not floating or dtype is not None and dtype.is_floating_point \
            and x.dtype != dtype:
        want = "a float input" if dtype is None else f"{dtype} input"
        fix = "x.float()" if dtype in (None, torch.float32) else f"x.to({dtype})"
        raise UnsupportedError(f"{what} is {x.dtype}; this model was built for {want}: pass "
                               f"it as at qfuse.prepare ({fix}).")
    if dtype is not None and not dtype.is_floating_point and (floating or x.is_complex()):
        raise UnsupportedError(f"{what} is {x.dtype}; this model was built for {dtype} input "
                               f"(indices): pass x.to({dtype}).")
    return x


DEVICE_REF = "qfuse_device"


def _reference_buffer(gm: fx.GraphModule) -> str:
    """An empty buffer that follows the model's ``.to(device)`` and that no fusion pass removes
    (a weight may be fused away); not persistent: saved files do not carry it."""
    if DEVICE_REF not in dict(gm.named_buffers()):
        tensors = list(gm.parameters()) + list(gm.buffers())
        device = tensors[0].device if tensors else torch.device("cpu")
        gm.register_buffer(DEVICE_REF, torch.empty(0, device=device), persistent=False)
    return DEVICE_REF


def guard_input_types(gm: fx.GraphModule) -> int:
    """Put ``check_input`` on every tensor input of ``gm`` (in place); returns how many (0 when
    it has them already: a converted copy of a prepared graph)."""
    if any(n.target is check_input for n in gm.graph.nodes):
        return 0
    ref_target = _reference_buffer(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"
                    and isinstance(n.meta.get("val"), torch.Tensor)]
    if not placeholders:
        return 0
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        ref = gm.graph.get_attr(ref_target)
    anchor = ref
    for node in placeholders:
        dtype = node.meta["val"].dtype
        name = node.name  # the checked value keeps the input's name (observers, QAT use it)
        node._rename(f"{name}_unchecked")
        gm.graph._graph_namespace._used_names.discard(name)  # free the name for the check
        with gm.graph.inserting_after(anchor):
            checked = gm.graph.create_node(
                "call_function", check_input, (node, f"input {node.target!r}", dtype, ref),
                name=name)
        checked.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(checked, delete_user_cb=lambda u, c=checked: u is not c)
        anchor = checked
    gm.graph.lint()
    gm.recompile()
    return len(placeholders)


def add_runtime_guards(gm: fx.GraphModule) -> None:
    """Input dtype/device checks, then NaN/Inf marks, on a converted graph (in place)."""
    guard_input_types(gm)
    guard_graph(gm)


def _check_hook(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not module.input_quantized:
        what = f"the input of a {type(module).__name__}"
        check_input(x, what, None, module._buffers["weight"])
        if x.dim() == 0:
            raise ShapeError(f"{what} is a 0-d tensor; pass [..., features] as the float layer "
                             "takes.")


def guard_module_inputs(model: nn.Module) -> int:
    """The same checks on each quantized layer of a swapped model (a forward pre-hook)."""
    hooked = 0
    for module in model.modules():
        if isinstance(module, QuantizedModule) and _check_hook not in \
                module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_check_hook)
            hooked += 1
    return hooked


def add_module_guards(model: nn.Module, float_inputs: bool = True) -> None:
    """The same on a swapped model (``convert(output="model")``): each quantized layer checks
    its input and, when the model has floating-point inputs (``float_inputs``, from the
    prepared graph: ``nonfinite.float_inputs_used``), marks its own non-finite rows (forward
    hooks)."""
    guard_module_inputs(model)
    if float_inputs:
        guard_model(model)
