"""The converted graph's view ops as tensor methods: cheaper to call in eager Python.

A graph captured by ``torch.export`` calls every op as an ``OpOverload``
(``torch.ops.aten.view.default(x, shape)``), which parses its arguments against the schema on each
call: 2-4 us of host time where ``x.view(shape)`` costs 1-1.5 (measured on the CI machine; the
H200 machine's host is slower still). BERT-base's converted graph runs ~150 such view, reshape,
transpose, slice and unsqueeze calls per forward, in plain eager all host time on a model that
is launch-bound. ``tensor_methods`` rewrites them as the equivalent ``call_method`` nodes (slices
as indexing), which compute the same views: nothing else in the graph changes, and
``torch.compile``, ``torch.export`` and TorchScript tracing see the same ops again.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten

# aten overload -> tensor method with the same positional arguments
_METHODS = {
    aten.view.default: "view",
    aten.reshape.default: "reshape",
    aten.transpose.int: "transpose",
    aten.unsqueeze.default: "unsqueeze",
    aten.permute.default: "permute",
}


def _slice_index(node: fx.Node):
    """``aten.slice.Tensor(x, dim, start, end, step)`` as the index ``x[:, ..., start:end:step]``,
    or None where the dimension is not a plain non-negative int."""
    names = ("dim", "start", "end", "step")
    arg = dict(zip(names, (0, None, None, 1), strict=True))
    arg.update(zip(names[: len(node.args) - 1], node.args[1:], strict=True))
    arg.update(node.kwargs)
    x, dim = node.args[0], arg["dim"]
    if not isinstance(dim, int) or dim < 0:
        return None
    return x, (slice(None),) * dim + (slice(arg["start"], arg["end"], arg["step"]),)


def tensor_methods(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s aten view ops as tensor-method calls (in place); returns how many.

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x.transpose(0, 1)[1:].reshape(-1)
        >>> gm = torch.export.export(M(), (torch.randn(3, 4),)).module()
        >>> x = torch.randn(3, 4)
        >>> expected = gm(x)
        >>> tensor_methods(gm) >= 2 and torch.equal(gm(x), expected)
        True
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        method = _METHODS.get(node.target)
        if method is not None and not node.kwargs:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_method(method, node.args)
        elif node.target is aten.slice.Tensor and (index := _slice_index(node)) is not None:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(operator.getitem, index)
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
