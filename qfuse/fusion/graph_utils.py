"""Small fx graph and module-tree helpers shared by the graph passes, flows and exporters."""

from __future__ import annotations

import torch
from torch import fx, nn


def erase_if_dead(gm: fx.GraphModule, nodes) -> None:
    """Erase each node in ``nodes`` (in order) that has no users, and parameters/buffers whose
    last reader was one of them, so a converted model does not keep its float weights alive."""
    for node in nodes:
        if node.users:
            continue
        inputs = [a for a in node.all_input_nodes if a.op == "get_attr"]
        if node.op == "get_attr":
            drop_attr(gm, node.target)
        gm.graph.erase_node(node)
        for attr in inputs:
            if not attr.users:
                drop_attr(gm, attr.target)
                gm.graph.erase_node(attr)


def find_submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path`` (dotted, ``""``: ``model`` itself), or None where there is none.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> type(find_submodule(model, "0")).__name__, find_submodule(model, "1")
        ('Linear', None)
    """
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def attr_tensor(gm: fx.GraphModule, target: str) -> torch.Tensor:
    """The parameter, buffer or plain tensor attribute a ``get_attr`` target names."""
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf)


def drop_attr(gm: fx.GraphModule, target: str) -> None:
    owner, _, leaf = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    if leaf in module._parameters:
        del module._parameters[leaf]
    elif leaf in module._buffers:
        del module._buffers[leaf]
    elif hasattr(module, leaf):
        delattr(module, leaf)
