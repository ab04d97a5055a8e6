"""``qfuse.prepare``: capture, fold BatchNorm, find fusible chains, insert observers."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx, nn

from qfuse.algorithms.awq import AWQ, AWQSamples
from qfuse.algorithms.awq import select as awq_select
from qfuse.algorithms.gptq import GPTQ
from qfuse.algorithms.gptq import select as gptq_select
from qfuse.algorithms.smoothquant import SmoothQuant
from qfuse.algorithms.smoothquant import select as smoothquant_select
from qfuse.config import QConfig, config_for
from qfuse.errors import UnsupportedError
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.fusion.patterns import Chain
from qfuse.observers import make_observer
from qfuse.observers.hessian import InputHessian
from qfuse.observers.samples import InputSamples
from qfuse.pipeline import PipelineOptions, resolve_options, run_capture
from qfuse.pipeline.capture import capture
from qfuse.state import QFuseState, set_state
from qfuse.validate import (
    ModelRef,
    check_eval_mode,
    check_layer_globs,
    explain_nothing_quantized,
    unlisted_float_layers,
)


def _check_supported(config) -> None:
    if not isinstance(config, QConfig):
        raise UnsupportedError(f"config must be a qfuse.QConfig, got {type(config).__name__}.")
    # Every QConfig that validates is implemented for Linear chains (int8/fp8, static/dynamic);
    # Conv2d chains are static int8 only, which convert checks per layer.


def _observer_name(node_name: str) -> str:
    return f"qfuse_observer_{node_name}"


def _geometry(gm: fx.GraphModule, chain: Chain) -> tuple:
    """What the rows of a chain's input Hessian are: Linear rows, or one Conv2d's patches."""
    if chain.kind == "linear":
        return ("linear",)
    c, kernel = chain.conv, tuple(attr_tensor(gm, chain.weight).shape[2:])
    return ("conv2d", kernel, *(tuple(c[k]) for k in ("stride", "padding", "dilation")))


def _insert_hessians(gm: fx.GraphModule, chains: list[Chain], gptq: GPTQ) -> dict[str, str]:
    """An ``InputHessian`` between each GPTQ layer's observer and the layer (one per input and
    row geometry: q/k/v share one). Returns chain name -> Hessian module name."""
    nodes = {n.name: n for n in gm.graph.nodes}
    picked = set(gptq_select(chains, gptq))
    by_key: dict[tuple, list[Chain]] = {}
    for chain in chains:
        if chain.name in picked:
            by_key.setdefault((chain.input, _geometry(gm, chain)), []).append(chain)
    hessians = {}
    for i, ((_, geometry), readers) in enumerate(by_key.items()):
        name = f"qfuse_hessian_{readers[0].input}" + (f"_{i}" if geometry[0] != "linear" else "")
        conv = None
        if geometry[0] == "conv2d":
            keys = ("kernel_size", "stride", "padding", "dilation")
            conv = dict(zip(keys, geometry[1:], strict=True))
        hessian = InputHessian(layer_name=_names(readers), conv=conv)
        _insert_reader(gm, nodes, readers, name, hessian)
        hessians.update((reader.name, name) for reader in readers)
    return hessians


def _insert_samples(gm: fx.GraphModule, chains: list[Chain], inputs: set[str],
                    recorder=InputSamples) -> dict[str, str]:
    """An ``InputSamples`` (or ``recorder``, a subclass) between each of ``inputs``' observer
    and its readers (SmoothQuant's and AWQ's searches). Returns chain input -> module name."""
    nodes = {n.name: n for n in gm.graph.nodes}
    samples = {}
    for inp in sorted(inputs):
        readers = [c for c in chains if c.input == inp]
        name = f"qfuse_samples_{inp}"
        _insert_reader(gm, nodes, readers, name, recorder(layer_name=_names(readers)))
        samples[inp] = name
    return samples


def _names(readers: list[Chain]) -> str:
    return f"{', '.join(r.name for r in readers)} (input)"


def _insert_reader(gm: fx.GraphModule, nodes: dict, readers: list[Chain], name: str,
                   module: nn.Module) -> None:
    """``module`` (as ``name``) between the observer ``readers`` share and each reader: it sees
    the float input each of them reads."""
    gm.add_submodule(name, module)
    observed = nodes[readers[0].anchor].args[0]  # the observer node every reader reads
    with gm.graph.inserting_after(observed):
        node = gm.graph.call_module(name, (observed,))
    for reader in readers:
        anchor = nodes[reader.anchor]
        anchor.args = (node, *anchor.args[1:])


def prepare(
    model: nn.Module,
    config: QConfig,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    layer_configs: Mapping[str, QConfig] | None = None,
    smoothquant: SmoothQuant | None = None,
    gptq: GPTQ | None = None,
    merge_siblings: bool | None = None,
    pipeline: PipelineOptions | None = None,
    awq: AWQ | None = None,
) -> fx.GraphModule:
    """Capture ``model`` and insert observers in front of every fusible Linear/Conv2d chain.

    Calibrate by calling the returned module on representative batches, then ``qfuse.convert``.
    The float model is not modified (BatchNorm is folded in the captured copy).
    ``layer_configs`` maps layer-name globs (``"encoder.layer.*.output.dense"``) to the QConfig
    whose observer and activation scheme those layers use (first match wins): its observer and
    symmetry, and static (per-tensor) or dynamic (per-token) activations, so a static model can
    keep per-token scales where one range per tensor cannot serve (a Llama's ``down_proj``:
    ``{"*.down_proj": QConfig.int8_dynamic()}``); a dynamic layer takes float from its producer
    and quantizes per token. Layers reading one shared input share one observer, configured by
    the first of them. ``smoothquant`` enables
    SmoothQuant (``qfuse.SmoothQuant(alpha=...)``): inputs of the smoothed layers get per-channel
    MinMax observers, whose statistics the smoothing factors need. ``gptq`` (``qfuse.GPTQ()``)
    also records each layer's input Hessian, and convert rounds the weights with GPTQ.
    ``awq`` (``qfuse.AWQ()``, 4-bit configs) records a sample of each layer's input, and convert
    scales and clips the weights by AWQ's search before GPTQ or round-to-nearest.
    ``merge_siblings`` merges Linears that read one input and end there (Q, K, V) into one layer
    over concatenated weights, named after its members (``fusion.siblings``), and the gate and
    up projections of a gated MLP (``act(gate(x)) * up(x)``, SwiGLU / GeGLU) into one layer with
    a gated epilogue (``fusion.gated``); True or False switches both (default: both on).
    ``pipeline`` (``qfuse.PipelineOptions``) chooses each graph pass instead; ``convert``,
    ``save`` and ``load`` run the same options (``qfuse.pipeline``).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> [row["pattern"] for row in qfuse.summary(qmodel).rows]
        ['Linear→ReLU', 'Linear']
    """
    for cfg in [config, *(layer_configs or {}).values()]:
        _check_supported(cfg)
        if cfg.dtype != config.dtype or cfg.weight_granularity != config.weight_granularity:
            raise UnsupportedError(
                "layer_configs may change the observer and activation scheme per layer, not the "
                "dtype or weight granularity; use keep_float in qfuse.convert for mixed precision."
            )
    options = resolve_options(pipeline, merge_siblings)
    return prepare_pipeline(
        model,
        config,
        example_inputs,
        example_kwargs,
        dynamic_shapes,
        options,
        layer_configs=layer_configs,
        smoothquant=smoothquant,
        gptq=gptq,
        awq=awq,
    )


def prepare_pipeline(
    model: nn.Module,
    config: QConfig,
    example_inputs: tuple,
    example_kwargs: dict | None,
    dynamic_shapes,
    options: PipelineOptions,
    *,
    replay: dict[str, list] | None = None,
    layer_configs: Mapping[str, QConfig] | None = None,
    smoothquant: SmoothQuant | None = None,
    gptq: GPTQ | None = None,
    awq: AWQ | None = None,
) -> fx.GraphModule:
    """``prepare`` with resolved pipeline ``options``; ``replay`` repeats recorded merges
    exactly (QAT's lowering replays its train-mode graph's: ``qfuse.flows.qat.lower``)."""
    check_eval_mode(model)
    gm = capture(model, example_inputs, example_kwargs, dynamic_shapes)
    run = run_capture(gm, options, replay=replay)
    chains, skipped = run.chains, run.skipped
    check_layer_globs(layer_configs, chains, "layer_configs")
    skipped += explain_nothing_quantized(type(model).__name__, chains, skipped)
    skipped += unlisted_float_layers(model, chains, skipped)
    nodes = {n.name: n for n in gm.graph.nodes}
    smoothed = smoothquant_select(gm, chains, smoothquant) if smoothquant else []
    smoothed_inputs = {c.input for c in chains if c.name in smoothed}
    awq_layers = awq_select(chains, awq, config) if awq is not None else []
    awq_inputs = {c.input for c in chains if c.name in awq_layers}
    observers: dict[str, str] = {}
    for chain in chains:
        if chain.input in observers:
            continue
        readers = [c.name for c in chains if c.input == chain.input]
        layer_config = config_for(chain.name, config, layer_configs)
        per_channel = chain.input in smoothed_inputs | awq_inputs
        obs = make_observer(
            "minmax" if per_channel else layer_config.observer,
            symmetric=layer_config.symmetric,
            channel_axis=-1 if per_channel else None,
            layer_name=f"{', '.join(readers)} (input)",
        )
        obs_name = _observer_name(chain.input)
        gm.add_submodule(obs_name, obs)
        observers[chain.input] = obs_name
        source = nodes[chain.input]
        with gm.graph.inserting_after(source):
            obs_node = gm.graph.call_module(obs_name, (source,))
        for reader in chains:
            if reader.input == chain.input:
                anchor = nodes[reader.anchor]
                anchor.args = (obs_node, *anchor.args[1:])
    search = smoothquant is not None and smoothquant.search
    sampled = (smoothed_inputs if search else set()) | awq_inputs
    samples = _insert_samples(gm, chains, sampled, AWQSamples if awq else InputSamples)
    hessians = _insert_hessians(gm, chains, gptq) if gptq is not None else {}
    gm.recompile()
    folded = run.records.get("fold_batchnorm", [])
    state = QFuseState(config, "prepared", chains, skipped, observers, folded_batchnorms=folded)
    state.merged, state.pipeline, state.passes = run.merged, options, dict(run.records)
    state.smoothquant, state.smoothed = smoothquant, smoothed
    state.gptq, state.hessians, state.samples = gptq, hessians, samples
    state.awq, state.awq_layers = awq, awq_layers
    state.layer_configs = dict(layer_configs or {})
    state.source = ModelRef(model)
    set_state(gm, state)
    return gm
