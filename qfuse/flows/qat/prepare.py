"""``qfuse.prepare_qat``: a train-mode graph with fake quant where convert will quantize."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from qfuse.config import PerChannel, QConfig, config_for
from qfuse.errors import ModeError, UnsupportedError
from qfuse.flows.qat.config import QATConfig
from qfuse.flows.qat.conv_bn import ConvBnFakeQuant
from qfuse.flows.qat.from_ptq import carry_over
from qfuse.flows.qat.graph import make_mode_aware
from qfuse.flows.qat.modules import WeightFakeQuant, make_activation_fq
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.fusion.patterns import Chain
from qfuse.fusion.siblings import merged_path
from qfuse.pipeline import PipelineOptions, resolve_options, run_capture
from qfuse.pipeline.capture import capture
from qfuse.state import QFuseState, set_state

aten = torch.ops.aten


@dataclass
class QATRecord:
    """What convert needs to turn the trained QAT model into fused layers (``qat.lower``)."""

    float_model: nn.Module  # the architecture; convert loads the trained tensors into a copy
    example_inputs: tuple
    example_kwargs: dict | None
    dynamic_shapes: object
    qat: QATConfig
    layer_configs: Mapping[str, QConfig] | None
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    passes: dict[str, list] = field(default_factory=dict)  # the train-mode graph's pass records
    act_fq: dict[str, str] = field(default_factory=dict)  # chain name -> ActivationFakeQuant
    weight_fq: dict[str, str] = field(default_factory=dict)  # chain name -> WeightFakeQuant
    prologue: set[str] = field(default_factory=set)  # chains smoothed in the prologue


def _check(model, config, layer_configs, qat) -> None:
    if not model.training:
        raise ModeError(
            f"prepare_qat expects {type(model).__name__} in train mode (QAT trains it); call "
            "model.train() first. For post-training quantization of an eval-mode model use "
            "qfuse.prepare."
        )
    for cfg in [config, *(layer_configs or {}).values()]:
        if not isinstance(cfg, QConfig):
            raise UnsupportedError(f"config must be a qfuse.QConfig, got {type(cfg).__name__}.")
        if cfg.dtype != config.dtype or cfg.weight_granularity != config.weight_granularity:
            raise UnsupportedError(
                "layer_configs may change the observer and activation scheme per layer, not the "
                "dtype or weight granularity."
            )
        if qat.learnable_scales and cfg.is_dynamic:
            raise UnsupportedError(
                "QATConfig(learnable_scales=True) needs a static activation scale for an observer "
                "to start it from, but a dynamic (PerToken) QConfig computes scales per token at "
                "run time. Use a static QConfig (int8_static / fp8_static) or learnable_scales="
                "False."
            )


def _batch_norm_after(conv: fx.Node) -> fx.Node | None:
    if len(conv.users) != 1:
        return None
    bn = next(iter(conv.users))
    if bn.op == "call_function" and bn.target == aten.batch_norm.default and bn.args[0] is conv:
        return bn
    return None


def _insert_weight_fq(gm, chain: Chain, nodes, config, qat, record) -> None:
    anchor = nodes[chain.anchor]
    weight = attr_tensor(gm, chain.weight)
    wfq = WeightFakeQuant(
        dtype=config.dtype,
        per_channel=isinstance(config.weight_granularity, PerChannel),
        learnable=qat.learnable_scales,
        out_channels=weight.shape[0],
    )
    safe = chain.name.replace(".", "_")
    bn = _batch_norm_after(anchor) if chain.kind == "conv2d" else None
    if bn is None:
        name = f"qfuse_qat_weight_{safe}"
        gm.add_submodule(name, wfq)
        with gm.graph.inserting_before(anchor):
            node = gm.graph.call_module(name, (anchor.args[1],))
        anchor.args = (anchor.args[0], node, *anchor.args[2:])
        if qat.learnable_scales:
            wfq.current_scale(weight)  # start LSQ from convert's own scale
        record.weight_fq[chain.name] = name
        return
    momentum, eps = bn.args[6], bn.args[7]
    if momentum is None:
        raise UnsupportedError(
            f"layer {chain.name}: BatchNorm with momentum=None (cumulative average) is not "
            "supported in QAT; give it a momentum (the default 0.1)."
        )
    bn_freeze = qat.bn_freeze_step if bn.args[5] else 0  # an eval-mode BN stays folded
    name = f"qfuse_qat_convbn_{safe}"
    module = ConvBnFakeQuant(chain.conv, eps, momentum, wfq, bn_freeze, chain.name)
    gm.add_submodule(name, module)
    if qat.learnable_scales:  # start LSQ from the scale of the weight folded with running stats
        var = attr_tensor(gm, bn.args[4].target)
        factor = torch.rsqrt(var + eps)
        if bn.args[1] is not None:  # affine BatchNorm
            factor = factor * attr_tensor(gm, bn.args[1].target)
        with torch.no_grad():
            wfq.current_scale(weight * factor.reshape(-1, 1, 1, 1))
    bias = anchor.args[2] if len(anchor.args) > 2 else None
    with gm.graph.inserting_before(bn):
        node = gm.graph.call_module(name, (anchor.args[0], anchor.args[1], bias, *bn.args[1:5]))
    node.meta = dict(bn.meta)
    bn.replace_all_uses_with(node)
    gm.graph.erase_node(bn)
    gm.graph.erase_node(anchor)
    nodes[bn.name] = node  # a later layer may read the BatchNorm's output
    record.weight_fq[chain.name] = f"{name}.weight_fq"


def _check_batch_norms(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.batch_norm.default:
            raise UnsupportedError(
                f"{node.name}: a BatchNorm that does not directly follow a quantized Conv2d is "
                "not supported by prepare_qat yet (it could not be kept in train mode nor "
                "folded); put it after a Conv2d or replace it."
            )


def prepare_qat(
    model: nn.Module,
    config: QConfig,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    qat: QATConfig | None = None,
    layer_configs: Mapping[str, QConfig] | None = None,
    from_prepared: fx.GraphModule | None = None,
    merge_siblings: bool | None = None,
    pipeline: PipelineOptions | None = None,
) -> fx.GraphModule:
    """Capture ``model`` (in train mode) with fake quant at every point ``qfuse.convert`` will
    quantize: each fusible layer's input (the prologue's rounding and clamping, static or
    dynamic) and weight (symmetric, per channel or per tensor), int8 or fp8. Conv2d + BatchNorm
    train on simulated folded weights (``qfuse.flows.qat.conv_bn``). Train the returned module, call
    ``.eval()``, then ``qfuse.convert`` it: same fused kernels as PTQ.

    ``qat`` (``qfuse.QATConfig``) picks observer-driven or learnable (LSQ) scales and the freeze
    steps. ``from_prepared``: a calibrated ``qfuse.prepare`` model of the same float model, whose
    activation scales, observers and SmoothQuant factors QAT starts from. ``model`` itself is not
    modified (QAT trains a copy; keep ``model`` as the float teacher). ``merge_siblings`` merges
    Q/K/V-like sibling Linears and the gate/up pair of a gated MLP into one layer as
    ``qfuse.prepare`` does (QAT trains the merged weight); ``pipeline`` (``qfuse.PipelineOptions``)
    chooses each graph pass instead. Both must match the ``from_prepared`` model's; convert
    runs the same options on the eval-mode graph, merging exactly the layers QAT merged.

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
        >>> x = torch.randn(32, 8)
        >>> qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> opt = torch.optim.SGD(qat.parameters(), lr=0.01)
        >>> for _ in range(3):
        ...     loss = qat(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
        >>> qmodel = qfuse.convert(qat.eval())
        >>> [row["pattern"] for row in qfuse.summary(qmodel).rows]
        ['Linear→ReLU', 'Linear']
    """
    qat = qat or QATConfig()
    _check(model, config, layer_configs, qat)
    options = resolve_options(pipeline, merge_siblings)
    float_model = copy.deepcopy(model)
    work = copy.deepcopy(model)
    gm = capture(work, example_inputs, example_kwargs, dynamic_shapes, training=True)
    run = run_capture(gm, options, training=True)
    chains, skipped, merged = run.chains, run.skipped, run.merged
    by_name = {c.name: c for c in chains}
    for members in merged:  # the merged weight trains if its members did
        chain = by_name[merged_path(members)]
        trainable = any(float_model.get_parameter(f"{m}.weight").requires_grad for m in members)
        for target in (chain.weight, chain.bias):
            if target is not None:
                attr_tensor(gm, target).requires_grad_(trainable)
    carried = {}
    if from_prepared is not None:
        carried = carry_over(from_prepared, chains, config, options)
    record = QATRecord(
        float_model,
        example_inputs,
        example_kwargs,
        dynamic_shapes,
        qat,
        layer_configs,
        options,
        dict(run.records),
    )
    nodes = {n.name: n for n in gm.graph.nodes}
    with torch.no_grad():
        for chain in chains:
            carry = carried.get(chain.name)
            if carry is not None and carry.weight is not None:
                attr_tensor(gm, chain.weight).copy_(carry.weight)
                if chain.bias is not None:
                    attr_tensor(gm, chain.bias).copy_(carry.bias)
    shared: dict[str, str] = {}  # source node -> its shared fake quant
    fq_nodes: dict[str, fx.Node] = {}  # fake quant module -> its call
    for i, chain in enumerate(chains):
        carry = carried.get(chain.name)
        prologue = carry is not None and carry.smoothing is not None
        if not prologue and chain.input in shared:
            record.act_fq[chain.name] = shared[chain.input]
        else:
            layer_config = config_for(chain.name, config, layer_configs)
            readers = [c.name for c in chains if c.input == chain.input and not prologue]
            fq = make_activation_fq(
                layer_config,
                qat,
                f"{', '.join(readers or [chain.name])} (input)",
                observer=carry.observer if carry else None,
                smoothing=carry.smoothing if prologue else None,
            )
            if carry is not None and not config.is_dynamic:
                fq.set_qparams(*carry.x_qparams)
            name = f"qfuse_qat_act_{chain.input}" + (f"_{i}" if prologue else "")
            gm.add_submodule(name, fq)
            source = nodes[chain.input]
            with gm.graph.inserting_after(source):
                fq_nodes[name] = gm.graph.call_module(name, (source,))
            record.act_fq[chain.name] = name
            if prologue:
                record.prologue.add(chain.name)
            else:
                shared[chain.input] = name
        anchor = nodes[chain.anchor]
        anchor.args = (fq_nodes[record.act_fq[chain.name]], *anchor.args[1:])
        _insert_weight_fq(gm, chain, nodes, config, qat, record)
    _check_batch_norms(gm)
    make_mode_aware(gm)
    gm.graph.lint()
    gm.recompile()
    state = QFuseState(config, "qat", chains, skipped)
    state.qat, state.merged = record, merged
    state.pipeline, state.passes = options, dict(run.records)
    set_state(gm, state)
    # Fake-quant modules, their observers and learnable scales are built on the CPU: put them
    # where the model is (DDP broadcasts every buffer over NCCL, which has no CPU backend). The
    # CPU-built LSQ scales are parameters too, so the CPU does not count.
    devices = {p.device for p in gm.parameters()} - {torch.device("cpu")}
    if len(devices) == 1:
        gm.to(devices.pop())
    return gm.train()
