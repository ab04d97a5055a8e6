"""Gate and up projections of a gated MLP (SwiGLU, GeGLU) as one GEMM with a gated epilogue.

``act(gate(x)) * up(x)``, with ``gate`` and ``up`` Linears that read the same input and end
there, becomes one ``aten.linear`` over the interleaved weight rows ``[g0, u0, g1, u1, ...]``
followed by ``qfuse::gated`` (``ops.gated``), at capture time, before observers go in. The
chain matcher sees ``Linear -> SwiGLU``: convert gives it one kernel whose epilogue computes
``act(gate) * up`` per pair of columns and writes N / 2 columns — int8/fp8 for the down
projection when it reads nothing else. One launch reads x once and fills the GPU with 2 x the
columns; the float gate and up outputs never reach memory.

Interleaved rather than concatenated: every even-width column tile of the GEMM then holds whole
(gate, up) pairs, whatever the schedule. The merged layer is named after its members
(``mlp.gate_proj_up_proj``); ``convert(output="model")`` splits it back (rows 0::2 and 1::2).
"""

from __future__ import annotations

import torch
from torch import fx, nn

import qfuse.ops  # noqa: F401  (registers qfuse::gated)
from qfuse.fusion.graph_utils import attr_tensor, erase_if_dead
from qfuse.fusion.patterns import find_chains
from qfuse.fusion.siblings import _merged_name, merge_sibling_linears

aten = torch.ops.aten
# The graph's gate activation -> the gated activation of the merged layer.
GATED_BY_ACT = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


def _pairs(gm: fx.GraphModule):
    """(gate chain, up chain, mul node) for each ``act(gate(x)) * up(x)`` in ``gm``."""
    chains, _ = find_chains(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    by_output = {c.output: c for c in chains}
    for gate in chains:
        if (gate.kind != "linear" or gate.activation not in GATED_BY_ACT
                or gate.residual is not None):
            continue
        out = nodes[gate.output]
        if len(out.users) != 1:
            continue
        mul = next(iter(out.users))
        if mul.op != "call_function" or mul.target != aten.mul.Tensor or len(mul.args) != 2:
            continue
        other = mul.args[1] if mul.args[0] is out else mul.args[0]
        up = by_output.get(other.name) if isinstance(other, fx.Node) else None
        if (up is None or up is gate or up.kind != "linear" or up.activation != "none"
                or up.residual is not None or up.input != gate.input or len(other.users) != 1):
            continue
        wg, wu = attr_tensor(gm, gate.weight), attr_tensor(gm, up.weight)
        if wg.shape != wu.shape or wg.dtype != wu.dtype:
            continue
        if mul.meta.get("val") is None or out.meta.get("val") is None:
            continue
        if mul.meta["val"].shape != out.meta["val"].shape:  # no broadcasting in the product
            continue
        yield gate, up, mul


def merge_gated_linears(gm: fx.GraphModule, only=None) -> list[list[str]]:
    """Merge each ``act(gate(x)) * up(x)`` of ``gm`` in place; returns ``[gate, up]`` names.
    ``only`` (a list of ``[gate, up]`` names) merges just those pairs: a replay of a recorded
    merge (``qfuse.pipeline``)."""
    merged = []
    nodes = {n.name: n for n in gm.graph.nodes}
    wanted = None if only is None else {tuple(g) for g in only}
    for gate, up, mul in list(_pairs(gm)):
        if wanted is not None and (gate.name, up.name) not in wanted:
            continue
        parent, leaf = _merged_name([gate.name, up.name])
        owner = gm.get_submodule(parent) if parent else gm
        if hasattr(owner, leaf):
            continue
        wg, wu = attr_tensor(gm, gate.weight), attr_tensor(gm, up.weight)
        holder = nn.Module()
        weight = torch.stack([wg.detach(), wu.detach()], dim=1).flatten(0, 1)
        holder.register_parameter("weight", nn.Parameter(weight, False))
        if gate.bias is not None or up.bias is not None:
            bg = attr_tensor(gm, gate.bias) if gate.bias else wg.new_zeros(wg.shape[0])
            bu = attr_tensor(gm, up.bias) if up.bias else wu.new_zeros(wu.shape[0])
            bias = torch.stack([bg.detach(), bu.detach()], dim=1).flatten()
            holder.register_parameter("bias", nn.Parameter(bias, False))
        owner.add_module(leaf, holder)
        path = f"{parent}.{leaf}" if parent else leaf
        anchor = nodes[gate.anchor]
        first = min((anchor, nodes[up.anchor]), key=lambda a: list(gm.graph.nodes).index(a))
        with gm.graph.inserting_before(first):
            w = gm.graph.get_attr(f"{path}.weight")
            b = gm.graph.get_attr(f"{path}.bias") if hasattr(holder, "bias") else None
            lin = gm.graph.call_function(aten.linear.default, (first.args[0], w, b))
            lin.meta = {k: v for k, v in anchor.meta.items() if k != "val"}
            vals = [anchor.meta.get("val"), nodes[up.anchor].meta.get("val")]
            if all(isinstance(v, torch.Tensor) for v in vals):
                with vals[0].fake_mode:
                    lin.meta["val"] = torch.cat(vals, dim=-1)
            act = GATED_BY_ACT[gate.activation]
            glu = gm.graph.call_function(torch.ops.qfuse.gated.default, (lin, act))
            glu.meta = dict(mul.meta)
        mul.replace_all_uses_with(glu)
        dead = [mul, *(nodes[n] for n in reversed(gate.nodes)),
                *(nodes[n] for n in reversed(up.nodes))]
        erase_if_dead(gm, dead)
        merged.append([gate.name, up.name])
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


def merge_siblings(gm: fx.GraphModule) -> list[list[str]]:
    """Every merge ``prepare(merge_siblings=True)`` does: gate/up pairs, then Q/K/V groups.

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate, self.up = nn.Linear(8, 16), nn.Linear(8, 16)
        ...         self.down = nn.Linear(16, 8)
        ...     def forward(self, x):
        ...         return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        >>> p = qfuse.prepare(MLP().eval(), qfuse.QConfig.int8_static(), (torch.randn(4, 8),))
        >>> from qfuse.state import get_state
        >>> [c.pattern for c in get_state(p).chains]
        ['Linear→SwiGLU', 'Linear']
    """
    return merge_gated_linears(gm) + merge_sibling_linears(gm)
