"""Where a layer's SmoothQuant / AWQ factor ``x / s`` folds when a Linear's output rows reach its
input through ops linear in them (``RowFold``), so the fold is free at run time and exact:

- ``up_rows``: ``down_proj`` of a gated MLP reads ``act(gate(x)) * up(x)``; channel j of the
  product is linear in ``up``'s output j, so ``up``'s row j (and bias) divided by ``s_j``
  divides it by ``s_j`` (llm-compressor's ``up_proj -> down_proj`` mapping). In a merged gate/up
  layer (``fusion.gated``: rows interleaved ``[g0, u0, g1, u1, ...]``) those are the odd rows.
- ``v_rows``: ``o_proj`` reads the attention output, per head a convex mix over tokens of the
  value rows: its channel (h, d) is linear in ``v_proj``'s output channel (kv(h), d) (AWQ's
  ``v_proj -> o_proj``). With grouped-query attention one ``v`` row serves every query head of
  its group, so those channels must share one factor (``tie``). The path from ``v_proj`` to
  SDPA and on to ``o_proj`` (views, transposes, ``repeat_kv``'s expand) is checked by replaying
  it on a tensor of channel indices: whatever the ops, each ``o_proj`` input channel must come
  from one ``v`` row at every position.

Each matcher also checks that nothing else reads the value on the way (another reader would see
the divided rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

import qfuse.ops  # noqa: F401  (registers qfuse::gated, the merged gate/up product)
from qfuse.fusion.patterns import Chain, is_eval_identity

aten = torch.ops.aten


def source(node: fx.Node) -> fx.Node:
    """Step back through eval-mode identities (dropout) to the node that computes the value."""
    while is_eval_identity(node):
        node = node.args[0]
    return node


@dataclass(frozen=True)
class RowFold:
    """Where a layer's ``x / s`` folds when a Linear's output rows reach its input through an op
    that is linear in them: input channel j is the output row ``rows[j]`` of the Linear chain
    ``producer`` (an index tensor, int64 [K]), so dividing that row (and its bias) by ``s_j``
    divides channel j by ``s_j``. ``member``: the layer owning those rows, for ``summary``
    (``up_proj`` of a merged ``gate_proj_up_proj``)."""

    producer: str
    rows: torch.Tensor
    member: str


def read_only_through(src: fx.Node, node: fx.Node, observer, anchor: str | None = None) -> bool:
    """``src`` -> eval identities -> ``node``, each read by the next only, and ``node`` read only
    by ``observer`` (the prepared model's observer of it, which its readers read through), or,
    before prepare inserts observers (``observer`` None), only by the node ``anchor``."""
    step = src
    while step is not node:
        if len(step.users) != 1:
            return False
        step = next(iter(step.users))
    users = list(node.users)
    if len(users) != 1:
        return False
    if observer is None:
        return users[0].name == anchor
    if users[0].op != "call_module":
        return False
    return node.graph.owning_module.get_submodule(users[0].target) is observer


def up_rows(nodes: dict[str, fx.Node], input_name: str, observer, chains: list[Chain],
            members: dict[str, list[str]] | None = None) -> RowFold | None:
    """The ``up`` rows a factor of the input ``input_name`` folds into, when that input is a
    gated product ``act(gate(x)) * up(x)`` read only through ``observer`` (None: by the one
    chain that reads it, before prepare inserts observers): the ``qfuse::gated`` op of a merged
    gate/up Linear (its odd rows) or an elementwise ``mul`` one operand of which is the output
    of a bare Linear chain read only by it. ``chains``: every chain of the model; ``members``:
    merged layer name -> its members (``QFuseState.merged``), for the fold's name. None for
    anything else (the layer then has no free fold)."""
    node = nodes[input_name]
    src = source(node)
    readers = [c for c in chains if c.input == input_name]
    if len(readers) != 1 or not read_only_through(src, node, observer, readers[0].anchor):
        return None
    by_output = {c.output: c for c in chains if c.kind == "linear"}
    if src.op != "call_function":
        return None
    if src.target == torch.ops.qfuse.gated.default:
        merged = by_output.get(src.name)
        if (merged is None or merged.residual is not None or merged.post_activation != "none"
                or len(merged.nodes) != 2 or nodes[merged.anchor] is not src.args[0]):
            return None
        out = src.meta.get("val")
        if out is None:
            return None
        k = out.shape[-1]
        names = (members or {}).get(merged.name)
        member = names[1].rpartition(".")[2] if names and len(names) == 2 else "up"
        return RowFold(merged.name, torch.arange(k) * 2 + 1, member)
    if src.target != aten.mul.Tensor or len(src.args) != 2:
        return None
    a, b = src.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    for up, other in ((b, a), (a, b)):  # the gate's activation usually comes first
        chain = by_output.get(up.name)
        if chain is None or len(chain.nodes) != 1 or len(up.users) != 1:
            continue
        vals = up.meta.get("val"), src.meta.get("val"), other.meta.get("val")
        if any(v is None for v in vals) or vals[0].shape != vals[1].shape:
            continue  # no broadcasting of up's output in the product
        if vals[2].dim() and vals[2].shape[-1] not in (1, vals[0].shape[-1]):
            continue  # the other factor scales each channel on its own (or all alike)
        return RowFold(chain.name, torch.arange(vals[0].shape[-1]), chain.name.rpartition(".")[2])
    return None


def tie(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``values`` [K] with channels that fold into one producer row (``rows[j]``, a
    ``RowFold``'s) replaced by their max: they must share one factor. ``rows`` None or
    one-to-one: ``values`` unchanged.

    Example:
        >>> tie(torch.tensor([1.0, 4.0, 2.0]), torch.tensor([0, 1, 0])).tolist()
        [2.0, 4.0, 2.0]
    """
    if rows is None or rows.unique().numel() == rows.numel():
        return values
    pooled = values.new_zeros(int(rows.max()) + 1).scatter_reduce(
        0, rows.to(values.device), values, "amax", include_self=False)
    return pooled[rows]


# Ops that move elements without computing (argument 0 the tensor moved): the path from v_proj
# to SDPA and from SDPA to o_proj may take only these, each read by the next op only.
_MOVES = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
    aten.slice.Tensor, aten.contiguous.default, aten.clone.default, aten.alias.default,
}
_SDPA = aten.scaled_dot_product_attention.default


def _hint(value):
    """A concrete int for a traced size (a SymInt's hint), recursively through lists; None when
    one has no hint."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.SymInt):
        return value.node.hint
    if isinstance(value, (list, tuple)):
        out = [_hint(v) for v in value]
        return None if any(v is None for v in out) else type(value)(out)
    return value


def _shape(node: fx.Node):
    val = node.meta.get("val")
    return _hint(list(val.shape)) if isinstance(val, torch.Tensor) else None


def _moves_back(node: fx.Node, stop) -> list[fx.Node] | None:
    """The ``_MOVES`` ops from ``stop(n)``'s node up to ``node`` (oldest first), each read only by
    the next; None where another op or reader comes first."""
    path = []
    while not stop(node):
        if node.op != "call_function" or node.target not in _MOVES:
            return None
        path.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
    return [node, *reversed(path)]


def _replay(index: torch.Tensor, path: list[fx.Node]) -> torch.Tensor | None:
    """``index`` moved by the ops of ``path`` at the traced sizes (their hints)."""
    for node in path:
        args = _hint(list(node.args[1:]))
        kwargs = {k: _hint(v) for k, v in node.kwargs.items()}
        if args is None or any(v is None for v in kwargs.values()):
            return None
        # contiguous first: the graph's views ran on its own strides; the order is the same
        index = node.target(index.contiguous(), *args, **kwargs)
        if list(index.shape) != _shape(node):
            return None
    return index


def v_rows(nodes: dict[str, fx.Node], input_name: str, observer, chains: list[Chain],
           members: dict[str, list[str]] | None = None) -> RowFold | None:
    """The ``v_proj`` rows a factor of the input ``input_name`` folds into, when that input is an
    attention output read only through ``observer`` (None: by the one chain that reads it):
    ``aten.scaled_dot_product_attention`` followed by ``_MOVES`` only, whose value comes through
    ``_MOVES`` only from a bare Linear chain's output, or from a slice of the last dimension of a
    merged Q/K/V Linear's output, read by nothing else. Replaying both paths on a tensor of
    ``v``'s channel indices gives, for each input channel, the ``v`` row it is a mix of; each
    channel must take one row at every position (several channels may share a row: GQA).
    ``rows`` then index the producer's weight rows. None for anything else."""
    node = nodes[input_name]
    src = source(node)
    readers = [c for c in chains if c.input == input_name]
    if len(readers) != 1 or not read_only_through(src, node, observer, readers[0].anchor):
        return None
    after = _moves_back(src, lambda n: n.op == "call_function" and n.target == _SDPA)
    if after is None or len(after[0].args) < 3 or after[0].kwargs.get("enable_gqa"):
        return None
    sdpa = after[0]
    value = sdpa.args[2]
    if not isinstance(value, fx.Node) or len(value.users) != 1:
        return None
    by_output = {c.output: c for c in chains if c.kind == "linear" and len(c.nodes) == 1}
    merged = {nodes[c.anchor].name: c for c in by_output.values()}

    def is_v(n: fx.Node) -> bool:
        if n.name in by_output:
            return True
        return (n.op == "call_function" and n.target == aten.slice.Tensor
                and isinstance(n.args[0], fx.Node) and n.args[0].name in merged)

    before = _moves_back(value, is_v)
    if before is None:
        return None
    start = before[0]
    if start.name in by_output:
        chain, offset = by_output[start.name], 0
        if len(start.users) != 1:
            return None
    else:  # a slice of a merged Q/K/V output: its rows [offset, offset + width)
        chain = merged[start.args[0].name]
        dim, lo = _hint(start.args[1]), _hint(start.args[2]) if len(start.args) > 2 else 0
        step = start.args[4] if len(start.args) > 4 else 1
        full = _shape(start.args[0])
        if full is None or dim not in (-1, len(full) - 1) or step != 1 or lo is None:
            return None
        offset = lo
    shape = _shape(start)
    if shape is None or not shape:
        return None
    width = shape[-1]
    index = _replay(torch.arange(width).expand(shape), before[1:])
    out_shape = _shape(sdpa)
    if index is None or out_shape is None or index.dim() < 2:
        return None
    # SDPA mixes value rows over the token axis (-2): a channel's row must not vary along it
    mixed = index.select(-2, 0).unsqueeze(-2)
    if not torch.equal(index, mixed.expand_as(index)) or list(index.shape[:-2]) != out_shape[:-2]:
        return None
    index = _replay(mixed.expand(out_shape), after[1:])
    if index is None or list(index.shape) != _shape(node):
        return None
    flat = index.reshape(-1, index.shape[-1])
    if not torch.equal(flat, flat[:1].expand_as(flat)):
        return None  # a channel that takes different v rows at different positions
    rows = flat[0] + offset
    member = chain.name
    names = (members or {}).get(chain.name)
    if names and start is not nodes[chain.anchor]:  # the member whose slice this is
        starts = sorted(_hint(u.args[2]) for u in nodes[chain.anchor].users
                        if u.target == aten.slice.Tensor and len(u.args) > 2)
        if len(starts) == len(names) and offset in starts:
            member = names[starts.index(offset)]
    return RowFold(chain.name, rows.clone(), member.rpartition(".")[2])


def row_fold(nodes: dict[str, fx.Node], input_name: str, observer, chains: list[Chain],
             members: dict[str, list[str]] | None = None) -> RowFold | None:
    """``up_rows`` or ``v_rows`` of the input ``input_name``, whichever matches; None if neither."""
    return (up_rows(nodes, input_name, observer, chains, members)
            or v_rows(nodes, input_name, observer, chains, members))
