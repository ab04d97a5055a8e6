"""The converted graph's view ops as tensor methods: cheaper to call in eager Python.

A graph captured by ``torch.export`` calls every op as an ``OpOverload``
(``torch.ops.aten.view.default(x, shape)``), which parses its arguments against the schema on each
call: about twice the host time of ``x.view(shape)``. A transformer's converted graph runs a view,
reshape, transpose, slice or unsqueeze call for every few GEMMs (BERT-base: ~150 per forward), in
plain eager all host time on a model that is launch-bound. ``tensor_methods`` rewrites them as
the equivalent ``call_method`` nodes (slices as indexing), which compute the same views: nothing
else in the graph changes, and ``torch.compile``, ``torch.export`` and TorchScript tracing see
the same ops again.

``skip_full_masks`` routes every boolean attention mask through ``ops.attention.drop_full_mask``,
which passes SDPA no mask in plain eager calls where nothing is masked, as transformers' own
forward does (and leaves traced, compiled and captured calls alone). ``eager_rewrites`` runs both.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qfuse.ops.attention import drop_full_mask

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default

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


def skip_full_masks(gm: fx.GraphModule) -> int:
    """Pass each boolean ``attn_mask`` of ``scaled_dot_product_attention`` through
    ``drop_full_mask`` (once per mask, shared by the attention calls reading it); in place,
    returns how many attention calls read a rewritten mask.

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, q, mask):
        ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, mask)
        >>> q, mask = torch.randn(1, 2, 4, 8), torch.ones(1, 1, 4, 4, dtype=torch.bool)
        >>> gm = torch.export.export(M(), (q, mask)).module()
        >>> expected = gm(q, mask)
        >>> skip_full_masks(gm), torch.allclose(gm(q, mask), expected)
        (1, True)
    """
    rewritten: dict[fx.Node, fx.Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        positional = len(node.args) > 3
        mask = node.args[3] if positional else node.kwargs.get("attn_mask")
        val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
            continue
        if mask not in rewritten:
            with gm.graph.inserting_after(mask):
                new = gm.graph.call_function(drop_full_mask, (mask,))
            new.meta = dict(mask.meta)
            rewritten[mask] = new
        if positional:
            node.update_arg(3, rewritten[mask])
        else:
            node.update_kwarg("attn_mask", rewritten[mask])
        count += 1
    if count:
        gm.recompile()
    return count


def eager_rewrites(gm: fx.GraphModule) -> None:
    """The converted graph's host-time rewrites: ``tensor_methods`` and ``skip_full_masks``."""
    tensor_methods(gm)
    skip_full_masks(gm)
