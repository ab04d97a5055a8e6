"""Checks shared by the exporters: the model is a converted qfuse model; two outputs are equal."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

from qfuse.errors import QFuseError
from qfuse.state import QFuseState, get_state


def converted_state(model, caller: str) -> QFuseState:
    """The ``QFuseState`` of a model returned by ``qfuse.convert`` or ``qfuse.load``."""
    state = get_state(model)
    if state is None or state.stage != "converted":
        got = "a prepared (not yet converted) model" if state else f"a {type(model).__name__}"
        raise QFuseError(
            f"{caller} expects a model returned by qfuse.convert or qfuse.load; got {got}. "
            "Run qfuse.convert on the calibrated prepared model first."
        )
    if not isinstance(model, fx.GraphModule):
        raise QFuseError(
            f"{caller} writes the fused graph, and this {type(model).__name__} came from "
            "qfuse.convert(prepared, output='model') (layers swapped into your model). Pass "
            "qfuse.convert(prepared) (output='graph') here; the swapped model saves with its own "
            "save_pretrained / torch.save."
        )
    return state


def normalize_inputs(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with a lone tensor wrapped in a tuple, as ``qfuse.prepare`` accepts."""
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return example_inputs, dict(example_kwargs or {})


def same_outputs(expected, actual) -> bool:
    """True when both outputs hold the same tensors (``torch.equal``) in the same order.

    Containers may differ in type (a traced model returns a ``dict`` where the eager one returned
    a Hugging Face ``ModelOutput``); only the flattened tensor leaves are compared.
    """
    a, b = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                return False
        elif x != y:
            return False
    return True
