"""``qfuse.convert(prepared, output="model")``: the user's model back, of its own class, with its
quantized layers swapped in place (as torchao's ``quantize_`` does), so that ``config``,
``generate``, ``save_pretrained`` and pipelines keep working.

The captured graph still decides what is quantized and how (observers, SmoothQuant, GPTQ, BatchNorm
folding, per-layer dtypes): each fusible chain whose anchor is a module (``nn.Linear``,
transformers' ``Conv1D``, ``nn.Conv2d``, ``nn.Conv1d``) is swapped for a ``QLinear`` / ``QConv2d`` /
``QConv1d`` built from the same plan as the graph result. What a module cannot express stays where
the model's forward computes it: an activation or residual add applied by the parent runs in float
after the quantized GEMM (``torch.compile`` fuses such elementwise tails around the compile-visible
kernels), and layers exchange float rather than int8. Sibling layers merged at prepare (Q, K, V)
stay one GEMM (``QSibling``); a merged gate/up stays one GEMM with its gated epilogue when the MLP
module can be swapped whole (``QGatedMLP``). ``qfuse.summary`` says, per layer, what the graph
chain was and which part the module took.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import fx, nn

from qfuse.errors import QFuseError
from qfuse.flows.build import build, record
from qfuse.flows.hooks import AFTER_SWAP  # run on every model convert_model returns
from qfuse.flows.plan import LayerPlan
from qfuse.fusion.graph_utils import find_submodule
from qfuse.fusion.patterns import ACTIVATION_NAMES, GATED, Chain, Skipped
from qfuse.nn import QConv2d, QLinear
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.nn.qconv1d import QConv1d
from qfuse.nn.qlinear4 import QLinear4
from qfuse.nn.siblings import QSibling
from qfuse.state import QFuseState, set_state

_FOLDED_BIAS = "folded_bias"



class _FloatFacing:
    """A swapped layer, seen from its parent's forward: ``weight`` reports the float dtype the
    layer computes in (as torchao's quantized tensors do). Models cast inputs to
    ``layer.weight.dtype`` (ViT's patch embedding: ``pixel_values.to(projection.weight.dtype)``);
    an int8 ``weight`` there turns the image into integers before the layer sees it. Inside
    ``forward`` (and in ``state_dict``, which reads the buffer) ``weight`` is the quantized tensor.
    Outside it, ``weight`` is an empty tensor of that dtype and device; ``qweight`` is the
    quantized one."""

    @property
    def weight(self):
        buffers = self.__dict__.get("_buffers", {})
        if "weight" not in buffers:
            raise AttributeError("weight")  # while nn.Module registers the buffer
        quantized = buffers["weight"]
        if quantized is None or self.__dict__.get("_in_kernel", False):
            return quantized
        return self.facing_weight()

    @property
    def qweight(self) -> torch.Tensor:
        return self._buffers["weight"]

    def forward(self, *args, **kwargs):
        self.__dict__["_in_kernel"] = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_in_kernel"] = False


class SwappedQLinear(_FloatFacing, QLinear):
    """``QLinear`` swapped into a user's model (``weight`` faces the parent as float)."""


class SwappedQConv2d(_FloatFacing, QConv2d):
    """``QConv2d`` swapped into a user's model (``weight`` faces the parent as float)."""


class SwappedQLinear4(_FloatFacing, QLinear4):
    """``QLinear4`` swapped into a user's model (``weight`` faces the parent as float)."""


def float_facing(module: nn.Module) -> nn.Module:
    """Make a ``QLinear`` / ``QLinear4`` / ``QConv2d`` face its parent as float (in place)."""
    if isinstance(module, QLinear4):
        module.__class__ = SwappedQLinear4
        return module
    module.__class__ = SwappedQLinear if isinstance(module, QLinear) else SwappedQConv2d
    return module


def is_float_facing(module: nn.Module) -> bool:
    return isinstance(module, _FloatFacing)


def _slot(model: nn.Module, chain: Chain, members: list[str] | None = None) -> str:
    """How ``chain`` maps onto a module of ``model``: "linear", "conv2d", "conv1d", "merged"
    (sibling Linears prepare merged into one layer: split back, one module each), or the reason
    it cannot be swapped (starting with "not swapped")."""
    if members:
        found = [find_submodule(model, m) for m in members]
        if all(isinstance(m, nn.Linear) for m in found):
            return "merged"
        return "not swapped: a merged layer's member is not an nn.Linear of the model"
    try:
        module = model.get_submodule(chain.name)
    except AttributeError:
        module = None
    if module is None or chain.weight != f"{chain.name}.weight":
        return (
            "not swapped: the GEMM is not a module's forward (e.g. F.linear in a parent's "
            "forward); output='graph' quantizes it"
        )
    if chain.kind == "linear" and (
        isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
    ):
        return "linear"
    if chain.kind == "conv2d" and isinstance(module, nn.Conv2d):
        return "conv2d"
    if chain.kind == "conv2d" and isinstance(module, nn.Conv1d):
        return "conv1d"
    return f"not swapped: {type(module).__name__} is not a module type qfuse swaps"


def _called(model: nn.Module, chain: Chain, anchor: fx.Node) -> str | None:
    """Why ``chain``'s module cannot be swapped although its weight is the GEMM's: the captured
    GEMM did not run in that module's forward, its parent computed it from the module's
    ``weight`` (``nn.MultiheadAttention`` passes ``out_proj.weight`` to
    ``F.multi_head_attention_forward``); a swapped module would hand the parent an empty
    float-facing weight. None when the module's own forward ran it (or the graph does not say)."""
    stack = anchor.meta.get("nn_module_stack") or {}
    if not stack or _in_module(anchor, chain.name):
        return None
    parent = chain.name.rpartition(".")[0]
    owner = type(model.get_submodule(parent)).__name__ if parent else type(model).__name__
    return (f"not swapped: {owner} computes it from {chain.name}.weight in its own forward "
            "(the module's forward never runs); output='graph' quantizes it")


def _off_fast_path(model: nn.Module) -> None:
    """``nn.TransformerEncoderLayer`` in eval runs one fused aten kernel over its own float
    weights (``torch._transformer_encoder_layer_fwd``, reading ``linear1.weight`` ...) unless a
    condition fails; with a swapped ``linear1``/``linear2`` it must run its module-by-module path.
    ``activation_relu_or_gelu`` only selects that fused kernel (and its nested-tensor path), and
    0 declines it."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and any(
                isinstance(getattr(module, n, None), QLinear) for n in ("linear1", "linear2")):
            module.activation_relu_or_gelu = 0


def _folded_batchnorms(prepared: fx.GraphModule, state: QFuseState) -> dict[str, str | None]:
    """Conv weight target -> the BatchNorm module folded into it (None if not a module).

    ``fold_batchnorm`` folds in graph order and names each fold's bias ``...folded_bias``, so the
    folded convs, in graph order, pair with ``state.folded_batchnorms``."""
    convs = [
        n
        for n in prepared.graph.nodes
        if n.op == "call_function"
        and n.target == torch.ops.aten.conv2d.default
        and len(n.args) > 2
        and isinstance(n.args[2], fx.Node)
        and str(n.args[2].target).endswith(_FOLDED_BIAS)
    ]
    pairs = {}
    for conv, bn in zip(convs, state.folded_batchnorms, strict=False):
        pairs[conv.args[1].target] = bn[: -len(".weight")] if bn.endswith(".weight") else None
    return pairs


# What parents read off their layers (MobileNetV2's TF padding reads kernel_size and stride,
# Whisper's encoder conv1.stride, GPT-2's Conv1D nf): copied from the float module.
_FLOAT_ATTRS = (
    "in_features",
    "out_features",
    "in_channels",
    "out_channels",
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "groups",
    "padding_mode",
    "nf",
    "nx",
)


def keep_float_attrs(float_module: nn.Module, quantized: nn.Module) -> nn.Module:
    """Copy what parents read off a layer (``_FLOAT_ATTRS``) from the float module."""
    for attr in _FLOAT_ATTRS:
        if attr in float_module.__dict__ and attr not in quantized.__dict__:
            setattr(quantized, attr, float_module.__dict__[attr])
    return quantized


def copy_public_attrs(float_module: nn.Module, swapped: nn.Module) -> nn.Module:
    """Copy a module swapped whole's public plain attributes (hidden_size, config, ...: what
    callers read) from the float module it replaces."""
    for attr, value in vars(float_module).items():
        if not attr.startswith("_") and attr != "training" and attr not in vars(swapped):
            setattr(swapped, attr, value)
    return swapped


def _left_to_forward(chain: Chain, model_name: str) -> str:
    parts = []
    if chain.activation != "none":
        parts.append(ACTIVATION_NAMES[chain.activation])
    if chain.residual is not None:
        parts.append("residual add")
    if chain.post_activation != "none":
        parts.append(f"{ACTIVATION_NAMES[chain.post_activation]} after it")
    if not parts:
        return ""
    return (
        f"graph chain {chain.pattern}: the {' and '.join(parts)} run in {model_name}.forward "
        "(module swap); output='graph' fuses the whole chain"
    )


def _in_module(node: fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(v[0] == path for v in stack.values())


def _gated_mlps(prepared: fx.GraphModule, chains: list[Chain], slots: dict) -> dict:
    """Parent module path -> (gate/up chain, down chain) for each gated MLP whose forward, in the
    captured graph, is exactly ``down(gated(gate_up(x)))``: nothing else runs inside it, so the
    module can be swapped whole (``QGatedMLP``) and the gated product stays fused."""
    found = {}
    for chain in chains:
        if chain.activation not in GATED or slots.get(chain.name) != "merged":
            continue
        parent = chain.name.rpartition(".")[0]
        readers = [c for c in chains if c.input == chain.output]
        if not parent or len(readers) != 1:
            continue
        down = readers[0]
        if (slots.get(down.name) != "linear" or down.activation != "none"
                or down.name.rpartition(".")[0] != parent):
            continue
        inside = {n.name for n in prepared.graph.nodes
                  if n.op == "call_function" and _in_module(n, parent)}
        if inside == {*chain.nodes, down.anchor}:
            found[parent] = (chain, down)
    return found


def _swap_gated_mlp(model, parent, chain, down, plan, config, float_dtype, layers):
    """Put a ``QGatedMLP`` at ``parent``: with static scales of one dtype, the gate/up epilogue
    quantizes the product for ``down`` (no float round trip between the two GEMMs)."""
    handoff = (not {chain.name, down.name} & plan.dynamic
               and plan.dtypes[chain.name] == plan.dtypes[down.name]
               and down.name not in plan.prologue)
    bare_down = dataclasses.replace(down, residual=None, post_activation="none",
                                    nodes=[down.anchor])
    gated = dataclasses.replace(chain, residual=None, post_activation="none")
    # Copies: save_pretrained refuses tensors shared between modules (down's x_scale).
    out_qparams = tuple(t.clone() if isinstance(t, torch.Tensor) else t
                        for t in plan.x_qparams[down.name]) if handoff else None
    gate_up = build(gated, config, plan, out_qparams, False,
                    torch.int8 if handoff else float_dtype)
    down_module = build(bare_down, config, plan, None, handoff, float_dtype)
    float_mlp = model.get_submodule(parent)
    mlp = copy_public_attrs(float_mlp, QGatedMLP(gate_up, down_module))
    model.set_submodule(parent, mlp)
    note = (f"gated MLP {parent} swapped whole ({type(float_mlp).__name__} → QGatedMLP): "
            f"gate and up as one GEMM, {ACTIVATION_NAMES[chain.activation]} in its epilogue")
    down_name = f"{parent}.down"
    layers.append(record(dataclasses.replace(gated, name=f"{parent}.gate_up"), gate_up,
                          f"{parent}.gate_up", None,
                          [dataclasses.replace(down, name=down_name)], [note]))
    layers.append(record(bare_down, down_module, down_name, f"{parent}.gate_up", [],
                          [f"{down.name} inside the swapped {parent}"]))


def _swap_merged(model, chain, bare, module, members, layers):
    """Swap in the members of a merged layer. Q/K/V-style siblings stay one GEMM
    (``QSibling``: the first member called on an input runs it, the others take their rows);
    a merged gate/up whose parent is not swapped whole is split back into two layers, the
    gated product left to the parent's forward."""
    float_members = [model.get_submodule(m) for m in members]
    if chain.activation in GATED:  # [gate, up] rows interleaved
        note = (f"split back from the merged layer {chain.name} "
                f"({ACTIVATION_NAMES[chain.activation]} runs in {type(model).__name__}.forward;"
                " output='graph' fuses it)")
        for i, (member, float_member) in enumerate(zip(members, float_members, strict=True)):
            part = module.rows(i, None, 2)
            model.set_submodule(member, keep_float_attrs(float_member, part))
            layers.append(record(dataclasses.replace(bare, name=member), part, member,
                                  None, [], [note]))
            float_facing(part)
        return
    siblings = QSibling.group(module, [m.out_features for m in float_members])
    for member, float_member, sibling in zip(members, float_members, siblings, strict=True):
        model.set_submodule(member, keep_float_attrs(float_member, sibling))
        others = ", ".join(m for m in members if m != member)
        note = (f"one GEMM with {others} (merged layer {chain.name}, held by {members[0]}): "
                f"the first member called on an input runs it, the others take their rows")
        layers.append(record(dataclasses.replace(bare, name=member), module, member,
                              None, [], [note]))


def convert_model(
    prepared: fx.GraphModule,
    state: QFuseState,
    chains: list[Chain],
    dtypes,
    notes: dict,
    inplace: bool,
) -> nn.Module:
    """Swap the quantized layers into the user's model (``qfuse.convert(..., output="model")``).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared, output="model")
        >>> type(qmodel).__name__, type(qmodel[0]).__name__, type(model[0]).__name__
        ('Sequential', 'SwappedQLinear', 'Linear')
        >>> qfuse.summary(qmodel).rows[0]["note"].split(":")[0]
        'graph chain Linear→GELU'
    """
    if state.source is None:
        raise QFuseError(
            "this prepared model does not hold the model it was prepared from; "
            "use qfuse.convert(prepared) (output='graph') or prepare the model again."
        )
    source = state.source.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = source if inplace else copy.deepcopy(source)
    if not inplace:
        model.requires_grad_(False)  # an inference artefact (see qfuse.convert)
    model.eval()
    bns = _folded_batchnorms(prepared, state)
    from qfuse.fusion.siblings import merged_path

    groups = {merged_path(g): g for g in state.merged}
    slots, unswapped = {}, []
    nodes = {n.name: n for n in prepared.graph.nodes}
    for chain in chains:
        slot = _slot(model, chain, groups.get(chain.name))
        if slot in ("linear", "conv2d", "conv1d"):
            slot = _called(model, chain, nodes[chain.anchor]) or slot
        if chain.bias and chain.bias.endswith(_FOLDED_BIAS) and bns.get(chain.weight) is None:
            slot = "not swapped: its folded BatchNorm is not a module the model can drop"
        if slot.startswith("not swapped"):
            unswapped.append(Skipped(chain.name, chain.kind, slot))
        else:
            slots[chain.name] = slot
    swapped = [c for c in chains if c.name in slots]
    hessians = {
        c.name: prepared.get_submodule(state.hessians[c.name])
        for c in swapped
        if c.name in state.hessians
    }
    plan = LayerPlan(prepared, state, swapped, state.observers, dtypes, hessians, fold_norms=True)
    plan.write_norm_weights(model)  # SmoothQuant's factors folded into RMSNorm weights
    layers = []
    mlps = _gated_mlps(prepared, swapped, slots)
    whole = {c.name: parent for parent, pair in mlps.items() for c in pair}
    for chain in swapped:
        if chain.name in whole:
            parent = whole[chain.name]
            if mlps[parent][0] is chain:
                float_dtype = nodes[chain.anchor].meta["val"].dtype
                _swap_gated_mlp(model, parent, chain, mlps[parent][1], plan, state.config,
                                float_dtype, layers)
            continue
        bare = dataclasses.replace(chain, activation="none", residual=None, post_activation="none",
                                   nodes=[chain.anchor])
        float_dtype = nodes[chain.anchor].meta["val"].dtype
        module = build(bare, state.config, plan, None, False, float_dtype)
        if slots[chain.name] == "merged":
            _swap_merged(model, chain, bare, module, groups[chain.name], layers)
            continue
        path = chain.name
        float_module = model.get_submodule(chain.name)
        if slots[chain.name] == "conv1d":
            model.set_submodule(chain.name, keep_float_attrs(float_module, QConv1d(module)))
            path = f"{chain.name}.conv"
        else:
            model.set_submodule(chain.name, keep_float_attrs(float_module, module))
        layer_notes = [n for n in (_left_to_forward(chain, type(model).__name__),) if n]
        bn = bns.get(chain.weight)
        if bn is not None:
            model.set_submodule(bn, nn.Identity())
            layer_notes.append(f"BatchNorm {bn} folded into the weights (module → Identity)")
        if chain.name in state.smoothed:
            layer_notes.append(plan.smoothquant_note(chain.name, state.smoothquant))
        if chain.name in plan.weight_scales:
            layer_notes.append(state.gptq.describe())
        if chain.name in notes:
            layer_notes.append(notes[chain.name])
        layers.append(record(bare, module, path, None, [], layer_notes))
        float_facing(module)
    _off_fast_path(model)
    result = copy.copy(state)
    result.stage, result.layers, result.observers, result.hessians = "converted", layers, {}, {}
    result.samples = {}
    result.skipped = unswapped + list(state.skipped)
    result.source = None
    set_state(model, result)
    for hook in AFTER_SWAP:
        hook(model)
    return model
