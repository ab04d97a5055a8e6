"""Sibling Linears (Q, K and V) as one GEMM over concatenated weights.

Linears that read the same input and end their chain there (no activation, no residual) are
merged at capture time, before observers go in: one ``aten.linear`` over ``cat(W_i)`` whose
output columns are sliced back to each reader. Everything downstream (observers, SmoothQuant,
GPTQ, convert, save/load) then sees one chain, named after its members
(``attention.self.query_key_value``). On the GPU one launch with N = 3d fills the SMs better
than three with N = d and reads the quantized input once.

A slice of the merged output is a strided view; a reader that ``view``s it into a shape that
needs contiguity would fail, so a group is merged only when every reader of every member is a
view/reshape that keeps the leading dimensions (how attention splits heads) or a non-view op.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qfuse.fusion.graph_utils import attr_tensor, erase_if_dead
from qfuse.fusion.patterns import find_chains

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _safe_reader(user: fx.Node, anchor: fx.Node) -> bool:
    if user.target not in _VIEWS:
        return user.op == "call_function"
    mine, theirs = anchor.meta.get("val"), user.meta.get("val")
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        return False
    lead = mine.dim() - 1
    return theirs.dim() > lead and all(a is b or a == b for a, b in
                                       zip(mine.shape[:lead], theirs.shape[:lead], strict=True))


def _merged_name(names: list[str]) -> tuple[str, str]:
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    parent = ".".join(parts[0][:common])
    leaf = "_".join("_".join(p[common:]) for p in parts)
    return parent, leaf


def merged_path(names: list[str]) -> str:
    """The layer name of the merged group of ``names`` (``attention.self.query_key_value``)."""
    parent, leaf = _merged_name(names)
    return f"{parent}.{leaf}" if parent else leaf


def merge_sibling_linears(gm: fx.GraphModule, only=None) -> list[list[str]]:
    """Merge each eligible group in place; returns the member layer names of every group.
    ``only`` (a list of member-name lists) merges just those groups: a replay of a recorded
    merge (``qfuse.pipeline``)."""
    wanted = None if only is None else {tuple(g) for g in only}
    chains, _ = find_chains(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    groups: dict[str, list] = {}
    for c in chains:
        if c.kind == "linear" and c.activation == "none" and c.residual is None:
            groups.setdefault(c.input, []).append(c)
    merged = []
    for members in groups.values():
        if len(members) < 2:
            continue
        if wanted is not None and tuple(c.name for c in members) not in wanted:
            continue
        anchors = [nodes[c.anchor] for c in members]
        weights = [attr_tensor(gm, c.weight) for c in members]
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            continue
        if not all(_safe_reader(u, a) for a in anchors for u in a.users):
            continue
        parent, leaf = _merged_name([c.name for c in members])
        owner = gm.get_submodule(parent) if parent else gm
        if hasattr(owner, leaf):
            continue
        holder = nn.Module()
        holder.register_parameter("weight", nn.Parameter(torch.cat(weights).detach(), False))
        if any(c.bias is not None for c in members):
            biases = [attr_tensor(gm, c.bias) if c.bias is not None
                      else weights[i].new_zeros(weights[i].shape[0])
                      for i, c in enumerate(members)]
            holder.register_parameter("bias", nn.Parameter(torch.cat(biases).detach(), False))
        owner.add_module(leaf, holder)
        path = f"{parent}.{leaf}" if parent else leaf
        first = min(anchors, key=lambda a: list(gm.graph.nodes).index(a))
        vals = [a.meta.get("val") for a in anchors]
        with gm.graph.inserting_before(first):
            w = gm.graph.get_attr(f"{path}.weight")
            b = gm.graph.get_attr(f"{path}.bias") if hasattr(holder, "bias") else None
            lin = gm.graph.call_function(aten.linear.default, (first.args[0], w, b))
            lin.meta = {k: v for k, v in first.meta.items() if k != "val"}
            if all(isinstance(v, torch.Tensor) for v in vals):
                with vals[0].fake_mode:
                    lin.meta["val"] = torch.cat(vals, dim=-1)
            start = 0
            for anchor, weight in zip(anchors, weights, strict=True):
                end = start + weight.shape[0]
                part = gm.graph.call_function(aten.slice.Tensor, (lin, -1, start, end))
                part.meta["val"] = anchor.meta.get("val")
                anchor.replace_all_uses_with(part)
                start = end
        erase_if_dead(gm, anchors)
        merged.append([c.name for c in members])
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged
