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
) -> fx.GraphModule:
    """An ``fx.GraphModule`` of aten ops equivalent to ``model`` in eval mode.

    Raises ``CaptureError`` naming the model and the likely fix when export fails.
    """
    kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    model.eval()
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
    return program.module()
