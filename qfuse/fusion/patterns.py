"""Fusible chains: ``Linear|Conv2d (+bias) -> [activation] -> [+ residual] -> [activation]``.

The matcher walks forward from each anchor (``aten.linear`` / ``aten.conv2d`` with a parameter
weight) through ops that are identities in eval mode (dropout), at most one activation and at most
one residual add, absorbing a node only when it is the sole user of the chain so far — so no
intermediate value that another op still needs is ever fused away. Conv chains also take one
activation after the residual add (a ResNet block's ``conv -> bn -> + identity -> relu``).

A residual add whose both inputs end chains (a projection shortcut: main branch and downsample
conv) goes to the chain whose output is computed last in graph order; the other operand is then
ready when the fused call runs, and no node is ever claimed by two chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

aten = torch.ops.aten

ANCHORS = {aten.linear.default: "linear", aten.conv2d.default: "conv2d"}
KIND_NAMES = {"linear": "Linear", "conv2d": "Conv2d"}
ACTIVATION_NAMES = {
    "relu": "ReLU",
    "gelu": "GELU",
    "gelu_tanh": "GELU(tanh)",
    "silu": "SiLU",
    "relu6": "ReLU6",
    "hardswish": "Hardswish",
    "swiglu": "SwiGLU",
    "geglu": "GeGLU",
    "geglu_tanh": "GeGLU(tanh)",
}
GATED = ("swiglu", "geglu", "geglu_tanh")  # act(gate) * up of a merged gate/up Linear
# Activations only the conv kernel implements so far; a Linear chain stops before them.
CONV_ONLY_ACTIVATIONS = ("relu6", "hardswish")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def activation_of(node: fx.Node) -> str | None:
    """The fusible activation ``node`` computes on its first argument, or None."""
    if node.op != "call_function":
        return None
    if str(node.target) == "qfuse.gated.default":  # a merged gate/up Linear's (fusion.gated)
        return node.args[1]
    if node.target in (aten.relu.default, aten.relu_.default):
        return "relu"
    if node.target in (aten.silu.default, aten.silu_.default):
        return "silu"
    if node.target in (aten.gelu.default, aten.gelu_.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    if node.target in (aten.hardswish.default, aten.hardswish_.default):
        return "hardswish"
    if node.target in (aten.hardtanh.default, aten.hardtanh_.default):  # nn.ReLU6
        args = node.args
        lo = args[1] if len(args) > 1 else node.kwargs.get("min_val", -1.0)
        hi = args[2] if len(args) > 2 else node.kwargs.get("max_val", 1.0)
        if float(lo) == 0.0 and float(hi) == 6.0:
            return "relu6"
    return None


def is_eval_identity(node: fx.Node) -> bool:
    """Ops that return their input unchanged in eval mode."""
    if node.op != "call_function":
        return False
    if node.target in (aten.dropout.default, aten.dropout_.default):
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is False
    return node.target in (aten.clone.default, aten.alias.default)


def residual_operand(add: fx.Node, cur: fx.Node) -> fx.Node | None:
    """The other operand if ``add`` is ``cur + other`` of the same shape (no broadcasting)."""
    if add.op != "call_function" or add.target not in (aten.add.Tensor, aten.add_.Tensor):
        return None
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    a, b = add.args
    other = b if a is cur else a if b is cur else None
    if not isinstance(other, fx.Node) or other is cur:
        return None
    mine, theirs = cur.meta.get("val"), other.meta.get("val")
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        return None
    if mine.shape != theirs.shape or not theirs.is_floating_point():
        return None
    return other


@dataclass
class Chain:
    """One fusible chain, by node names (names survive ``copy.deepcopy`` of the graph)."""

    name: str  # module path of the anchor's weight owner, e.g. "encoder.layer.0.output.dense"
    kind: str  # "linear" | "conv2d"
    anchor: str
    input: str
    weight: str  # get_attr target
    bias: str | None
    activation: str = "none"
    residual: str | None = None
    nodes: list[str] = field(default_factory=list)  # anchor first, chain output last
    conv: dict | None = None  # stride, padding, dilation, groups
    post_activation: str = "none"  # after the residual add (conv chains only)

    @property
    def output(self) -> str:
        return self.nodes[-1]

    @property
    def pattern(self) -> str:
        parts = [KIND_NAMES[self.kind]]
        if self.activation != "none":
            parts.append(ACTIVATION_NAMES[self.activation])
        if self.residual is not None:
            parts.append("residual")
        if self.post_activation != "none":
            parts.append(ACTIVATION_NAMES[self.post_activation])
        return "→".join(parts)


@dataclass
class Skipped:
    """A Linear/Conv2d that stays float, and why."""

    name: str
    kind: str
    reason: str


def _attr_target(node) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _layer_name(node: fx.Node, weight_target: str | None) -> str:
    if weight_target and weight_target.endswith(".weight"):
        return weight_target[: -len(".weight")]
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        if path:
            return f"{path}.{node.name}"
    return node.name


def _conv_args(node: fx.Node) -> dict:
    defaults = [None, None, None, [1, 1], [0, 0], [1, 1], 1]
    args = list(node.args) + defaults[len(node.args) :]
    pair = lambda v: [int(v[0]), int(v[-1])]  # noqa: E731 - one-liner normaliser
    return dict(stride=pair(args[3]), padding=pair(args[4]), dilation=pair(args[5]), groups=args[6])


def _why_not(node: fx.Node, kind: str) -> str | None:
    weight = node.args[1]
    if _attr_target(weight) is None:
        return "weight is computed at run time, not a parameter"
    if len(weight.users) > 1:
        return "weight is shared with another op (tied); quantizing it would change the other op"
    if kind == "conv2d":
        if isinstance(node.args[4] if len(node.args) > 4 else 0, str):
            return "string padding ('same'/'valid') is not supported yet"
        if node.meta.get("val") is None or node.meta["val"].dim() != 4:
            return "only 4-D (batched NCHW) convolution input is supported"
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in FLOAT_DTYPES:
        dtype = getattr(val, "dtype", type(val).__name__)
        return f"input dtype {dtype} is not float32/bfloat16/float16"
    bias = node.args[2] if len(node.args) > 2 else None
    if bias is not None and _attr_target(bias) is None:
        return "bias is computed at run time, not a parameter"
    return None


def _fusible_activation(node: fx.Node, kind: str) -> str | None:
    act = activation_of(node)
    if act in CONV_ONLY_ACTIVATIONS and kind != "conv2d":
        return None
    if act in GATED and kind != "linear":  # only the GEMM epilogue implements them
        return None
    return act


def _walk(chain: Chain, cur: fx.Node, *, post: bool) -> fx.Node:
    """Extend ``chain`` from ``cur`` through eval identities and at most one activation (the
    post-residual one when ``post``); returns the chain's last node."""
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if is_eval_identity(user):
            pass
        elif (act := _fusible_activation(user, chain.kind)) and (
            chain.post_activation == "none" if post else chain.activation == "none"
        ):
            if post:
                chain.post_activation = act
            else:
                chain.activation = act
        else:
            break
        chain.nodes.append(user.name)
        cur = user
    return cur


def find_chains(gm: fx.GraphModule) -> tuple[list[Chain], list[Skipped]]:
    """All fusible chains of ``gm`` in graph order, and the anchors left float with a reason."""
    chains, skipped, ends = [], [], []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        kind = ANCHORS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        weight_target = _attr_target(node.args[1])
        name = _layer_name(node, weight_target)
        reason = _why_not(node, kind)
        if reason is not None:
            skipped.append(Skipped(name, kind, reason))
            continue
        bias = node.args[2] if len(node.args) > 2 else None
        chain = Chain(
            name=name,
            kind=kind,
            anchor=node.name,
            input=node.args[0].name,
            weight=weight_target,
            bias=_attr_target(bias),
            nodes=[node.name],
            conv=_conv_args(node) if kind == "conv2d" else None,
        )
        chains.append(chain)
        ends.append(_walk(chain, node, post=False))
    # Residual adds: each goes to the candidate chain whose output is computed last.
    claims: dict[fx.Node, tuple[int, Chain, fx.Node]] = {}
    for chain, end in zip(chains, ends, strict=True):
        if len(end.users) != 1:
            continue
        add = next(iter(end.users))
        other = residual_operand(add, end)
        if other is None:
            continue
        if add not in claims or order[end] > claims[add][0]:
            claims[add] = (order[end], chain, other)
    for add, (_, chain, other) in claims.items():
        chain.residual = other.name
        chain.nodes.append(add.name)
        if chain.kind == "conv2d":
            _walk(chain, add, post=True)
    return chains, skipped
