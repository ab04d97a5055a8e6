"""GEMMs where models put them: rewrite parameter-weight ``addmm`` / ``mm`` / ``matmul`` and
``conv1d`` into the ``linear`` / ``conv2d`` anchors the chain matcher fuses.

- transformers' ``Conv1D`` (GPT-2 family) computes ``addmm(bias, x, W)`` with ``W`` stored
  ``[in, out]``; ``x @ W`` with a parameter ``W`` is the same GEMM without bias. The captured
  graph's copy of ``W`` is replaced by its transpose and the node by ``linear(x, W^T, bias)``.
- ``nn.Conv1d`` (Whisper and wav2vec2 front-ends) is a ``conv2d`` over a height-1 image: the
  weight gains a unit height and the node becomes ``squeeze(conv2d(unsqueeze(x)))``.

Only the captured graph's parameters change (the float model keeps its own), and only when every
reader of the weight is such a GEMM. Both ``prepare`` and ``load`` run this (inside ``capture``),
so saved files see the same layer shapes. ``leftover_gemms`` names what stays float, and why.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qfuse.fusion.patterns import Skipped

aten = torch.ops.aten
_TRANSPOSED = {aten.addmm.default: (1, 2, 0), aten.mm.default: (0, 1, None)}
_TRANSPOSED[aten.matmul.default] = (0, 1, None)


def _param(gm: fx.GraphModule, node) -> tuple[nn.Module, str, torch.Tensor] | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    owner_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(owner_path)
    value = getattr(owner, attr, None)
    return (owner, attr, value) if isinstance(value, torch.Tensor) else None


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _transposed_gemm(node: fx.Node) -> tuple | None:
    """(x, W, bias) of ``addmm(bias, x, W)`` / ``mm(x, W)`` / ``matmul(x, W)`` with a 2-D W."""
    spec = _TRANSPOSED.get(node.target) if node.op == "call_function" else None
    if spec is None or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    x, w = node.args[spec[0]], node.args[spec[1]]
    bias = node.args[spec[2]] if spec[2] is not None else None
    xv, wv = _val(x), _val(w)
    if xv is None or wv is None or wv.dim() != 2 or xv.dim() < 2:
        return None
    if bias is not None and (_val(bias) is None or _val(bias).dim() != 1):
        return None
    return x, w, bias


def _conv1d(node: fx.Node) -> tuple | None:
    """The arguments of a batched ``conv1d`` with numeric padding."""
    if node.op != "call_function" or node.target != aten.conv1d.default:
        return None
    args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2 :]
    x, w, bias, stride, padding, dilation, groups = args
    if isinstance(padding, str) or _val(x) is None or _val(x).dim() != 3:
        return None
    return x, w, bias, stride, padding, dilation, groups


def _replace_param(owner: nn.Module, attr: str, value: torch.Tensor) -> None:
    setattr(owner, attr, nn.Parameter(value.contiguous(), requires_grad=False))


def _fake(val: torch.Tensor, fn):
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return fn(val)
    with mode:
        return fn(val)


def canonicalize_gemms(gm: fx.GraphModule) -> int:
    """Rewrite transposed-weight GEMMs and conv1d into linear / conv2d; returns how many.

    Example:
        >>> import torch
        >>> from qfuse.pipeline.capture import capture
        >>> class Proj(torch.nn.Module):  # transformers' Conv1D: weight stored [in, out]
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.randn(8, 4))
        ...         self.bias = torch.nn.Parameter(torch.zeros(4))
        ...     def forward(self, x):
        ...         return torch.addmm(self.bias, x, self.weight)
        >>> gm = capture(Proj(), (torch.randn(3, 8),))  # capture calls canonicalize_gemms
        >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"][-1:]
        ['aten.linear.default']
        >>> tuple(gm.weight.shape)
        (4, 8)
    """
    done = 0
    for node in list(gm.graph.nodes):
        if (gemm := _transposed_gemm(node)) is not None:
            x, w, bias = gemm
            found = _param(gm, w)
            if found is None or any(_transposed_gemm(u) is None for u in w.users):
                continue
            if any(_transposed_gemm(u)[1] is not w for u in w.users):
                continue
            owner, attr, value = found
            _replace_param(owner, attr, value.detach().t())
            w.meta["val"] = _fake(w.meta["val"], lambda v: v.t().contiguous())
            for user in list(w.users):
                ux, _, ub = _transposed_gemm(user)
                with gm.graph.inserting_before(user):
                    args = (ux, w) if ub is None else (ux, w, ub)
                    linear = gm.graph.call_function(aten.linear.default, args)
                linear.meta = dict(user.meta)
                user.replace_all_uses_with(linear)
                gm.graph.erase_node(user)
                done += 1
        elif (conv := _conv1d(node)) is not None:
            x, w, bias, stride, padding, dilation, groups = conv
            found = _param(gm, w)
            if found is None or any(_conv1d(u) is None or _conv1d(u)[1] is not w for u in w.users):
                continue
            owner, attr, value = found
            _replace_param(owner, attr, value.detach().unsqueeze(2))
            w.meta["val"] = _fake(w.meta["val"], lambda v: v.unsqueeze(2))
            for user in list(w.users):
                ux, _, ub, s, p, d, g = _conv1d(user)
                with gm.graph.inserting_before(user):
                    x4 = gm.graph.call_function(aten.unsqueeze.default, (ux, 2))
                    conv2 = gm.graph.call_function(
                        aten.conv2d.default,
                        (x4, w, ub, [1, s[0]], [0, p[0]], [1, d[0]], g),
                    )
                    out = gm.graph.call_function(aten.squeeze.dim, (conv2, 2))
                for new in (x4, conv2, out):
                    new.meta = {k: v for k, v in user.meta.items() if k != "val"}
                x4.meta["val"] = _fake(_val(ux), lambda v: v.unsqueeze(2))
                conv2.meta["val"] = _fake(_val(user), lambda v: v.unsqueeze(2))
                out.meta["val"] = _val(user)
                user.replace_all_uses_with(out)
                gm.graph.erase_node(user)
                done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


_LEFTOVER = {
    aten.conv1d.default: "conv1d",
    aten.conv1d.padding: "conv1d",
    aten.conv2d.padding: "conv2d",
    aten.addmm.default: "linear",
    aten.mm.default: "linear",
    aten.matmul.default: "linear",
    aten.conv_transpose1d.default: "conv_transpose",
    aten.conv_transpose2d.input: "conv_transpose",
    aten.conv3d.default: "conv3d",
}


def leftover_gemms(gm: fx.GraphModule) -> list[Skipped]:
    """GEMMs with a weight from the model (a parameter, or computed from one as weight_norm
    does) that ``canonicalize_gemms`` could not turn into a fusible anchor, with the reason."""
    skipped = []
    for node in gm.graph.nodes:
        kind = _LEFTOVER.get(node.target) if node.op == "call_function" else None
        if kind is None or len(node.args) < 2:
            continue
        w = node.args[1] if node.target != aten.addmm.default else node.args[2]
        if not isinstance(w, fx.Node) or not _from_parameters(w):
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        name = stack[-1][0] if stack and stack[-1][0] else node.name
        if w.op != "get_attr":
            reason = "weight is computed at run time (e.g. weight_norm), not a parameter"
        elif len(w.users) > 1:
            reason = "weight is shared with another op (tied); quantizing it would change it"
        elif node.target in (aten.conv1d.padding, aten.conv2d.padding):
            reason = f"string padding ({node.args[4]!r}) is not supported yet"
        elif kind == "conv1d":
            reason = "conv1d of unbatched input is not supported yet"
        else:
            reason = f"{node.target} with this operand layout is not a supported GEMM yet"
        skipped.append(Skipped(name, kind, reason))
    return skipped


def _from_parameters(node: fx.Node, depth: int = 6) -> bool:
    """Whether ``node`` is a parameter or computed only from parameters (no graph input)."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or depth == 0:
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(_from_parameters(n, depth - 1) for n in inputs)
