"""Graph capture: ``torch.export`` (non-strict) of the float model, with a dynamic batch dimension.

Why export and not ``torch.fx.symbolic_trace``: symbolic tracing fails on Hugging Face BERT
(data-dependent control flow on tensor values and shapes) and transformers 5 no longer ships an
fx tracer, while non-strict export runs the real Python with fake tensors, captures MiniLM in about
a second, keeps ``aten.linear`` un-decomposed with ``nn_module_stack`` naming each module, and
accepts symbolic (dynamic) dimensions, so one captured graph serves every batch size.
"""

from __future__ import annotations

import inspect

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.errors import CaptureError


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Mark dim 0 (batch) of every tensor input as ``Dim.AUTO``; export keeps it static if the
    model forces it (e.g. an example batch of 1 specialises)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return {0: torch.export.Dim.AUTO}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def capture(
    model: nn.Module,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    *,
    training: bool = False,
) -> fx.GraphModule:
    """An ``fx.GraphModule`` of aten ops equivalent to ``model`` in eval mode (``training=True``:
    in train mode, for QAT: dropout and batch-statistics BatchNorm stay in the graph).

    Raises ``CaptureError`` naming the model and the likely fix when export fails.
    """
    kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    model.train(training)
    if dynamic_shapes is None:
        dynamic_shapes = default_dynamic_shapes(model, example_inputs, kwargs)
    try:
        program = torch.export.export(
            model, example_inputs, kwargs, dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as exc:  # export raises many types; all mean "could not capture"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"could not capture {type(model).__name__} with torch.export: {first_line}. "
            "Make the forward traceable (no data-dependent Python control flow on tensor values, "
            "no unsupported Python side effects), pass example inputs of the shapes you serve, or "
            "quantize the traceable submodule instead."
        ) from exc
    gm = program.module()
    follow_input_device(gm)
    return gm


def _example_device(gm: fx.GraphModule) -> torch.device | None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device
    return None


def follow_input_device(gm: fx.GraphModule) -> int:
    """Make device constants in the captured graph follow the first tensor input's device.

    Export records the capture device in ops such as ``arange(..., device=cpu)``,
    ``to(device=cpu)`` and ``_assert_tensor_metadata``; left alone, a model captured (and
    converted) on CPU fails after ``.to("cuda")``. Every constant equal to the capture device is
    replaced by ``input.device`` at run time. Returns how many arguments were rewritten.
    """
    device = _example_device(gm)
    if device is None:
        return 0
    first_input = next(
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    device_node = None
    rewritten = 0

    def swap(value):
        nonlocal device_node, rewritten
        if isinstance(value, torch.device) and value == device:
            if device_node is None:
                last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
                with gm.graph.inserting_after(last_placeholder):
                    device_node = gm.graph.call_function(getattr, (first_input, "device"))
            rewritten += 1
            return device_node
        return value

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node is device_node:
            continue
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    if rewritten:
        gm.recompile()
    return rewritten
