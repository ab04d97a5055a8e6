"""``qfuse.convert``: turn a calibrated prepared model into fused quantized modules.

Each chain becomes one call_module node (QLinear/QConv2d) at the chain's module path. A chain
whose output is read only by other quantized chains that agree on one input scale hands them int8
(requantized in its epilogue); every other output is float in the model's dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import fx

from qfuse.config import PerToken
from qfuse.errors import QFuseError, UnsupportedError
from qfuse.flows.build import QUANT_NAMES, build, record
from qfuse.flows.plan import LayerPlan
from qfuse.flows.qat.lower import lower
from qfuse.flows.swap import convert_model
from qfuse.fusion.guards import add_module_guards, add_runtime_guards
from qfuse.fusion.nonfinite import float_inputs_used
from qfuse.fusion.patterns import Chain, Skipped
from qfuse.fusion.rewrite import module_paths, remove_observers
from qfuse.pipeline import PipelineOptions, run_fused
from qfuse.pipeline.pickling import make_picklable
from qfuse.state import QFuseState, get_state, set_state


def _state(model) -> QFuseState:
    state = get_state(model)
    if state is None or state.stage != "prepared":
        raise QFuseError(
            "qfuse.convert expects the model returned by qfuse.prepare (and calibrated); "
            f"got {type(model).__name__}" + (" that is already converted." if state else ".")
        )
    return state


def _handoff_readers(chain, readers_of, residual_of, nodes, observers, plan):
    """The chains this chain can hand int8 to, as (input readers, residual readers): the input
    readers read the output through its observer, take their input unsmoothed or folded and
    agree on one input scale; every other reader must be the residual add of a fused conv chain
    (it dequantizes the residual in its epilogue with that same scale). Nothing else may read
    the output, and all of them share this chain's dtype."""
    out = nodes[chain.output]
    obs_name = observers.get(chain.output)
    if obs_name is None:
        return [], []
    obs_nodes = [u for u in out.users if u.op == "call_module" and u.target == obs_name]
    if len(obs_nodes) != 1:
        return [], []
    (obs_node,) = obs_nodes
    readers = readers_of.get(chain.output, [])
    if {u.name for u in obs_node.users} != {r.anchor for r in readers}:
        return [], []
    others = {u.name for u in out.users} - {obs_node.name}
    res_readers = [r for r in residual_of.get(chain.output, []) if others & set(r.nodes)]
    claimed = set().union(*(set(r.nodes) for r in res_readers)) if res_readers else set()
    if not others <= claimed or any(r.kind != "conv2d" for r in res_readers):
        return [], []
    if any(r.name in plan.prologue for r in readers):
        return [], []
    if any(plan.dtypes[r.name] != plan.dtypes[chain.name] for r in readers + res_readers):
        return [], []  # an int8 layer cannot hand fp8 to an fp8 one (or the reverse)
    if chain.name in plan.dynamic or any(r.name in plan.dynamic for r in readers + res_readers):
        return [], []  # a per-token layer takes and gives float
    if any(plan.x_qparams[r.name][0] is None for r in readers):
        return [], []  # dynamic layers without calibration: no static scale to hand over with
    scales = {(float(plan.x_qparams[r.name][0]), int(plan.x_qparams[r.name][1])) for r in readers}
    return (readers, res_readers) if len(scales) == 1 else ([], [])


def convert(
    prepared: fx.GraphModule,
    inplace: bool = False,
    keep_float: Mapping[str, str] | None = None,
    layer_dtypes: Mapping[str, torch.dtype] | None = None,
    notes: Mapping[str, str] | None = None,
    output: str = "graph",
    fuse_norms: bool | None = None,
    fuse_pools: bool | None = None,
    fuse_attention: bool | None = None,
    per_token: Iterable[str] | None = None,
) -> fx.GraphModule | torch.nn.Module:
    """Replace every calibrated chain of ``prepared`` with its fused quantized module.

    ``output="graph"`` (the default) returns the captured ``fx.GraphModule`` with every chain
    fused (activations, residual adds and int8 hand-offs included): the artefact for
    ``qfuse.save``, ``export_program``, ``auto_fallback`` and routing. ``output="model"`` returns
    the model ``prepare`` was given, of its own class, with its quantized layers swapped in
    (a deep copy, or the model itself with ``inplace=True``): transformers' ``generate``,
    ``config`` and pipelines keep working; see ``qfuse.flows.swap``.

    ``keep_float`` maps layer names to the reason they stay in float (mixed precision, e.g. from
    ``qfuse.auto_fallback``); ``qfuse.summary`` shows the reason. ``layer_dtypes`` gives layers
    another quantized dtype than the config's (``torch.int8`` / ``torch.float8_e4m3fn``: fp8 for
    the layers int8 serves worst keeps them fused and fast); int8 and fp8 layers exchange float.
    ``notes`` adds a per-layer note to ``qfuse.summary`` (why a layer got its dtype).
    ``fuse_norms`` lets a LayerNorm read by static quantized layers quantize its output for them
    in the same kernel (``fusion.norm_quant``; False keeps ATen's LayerNorm and the readers
    quantize in their prologue). ``fuse_pools`` lets a conv read only through a max-pool by
    fused convs requantize for them, the pool then runs on int8/fp8 (``fusion.pool_quant``;
    False keeps ATen's float max-pool). ``fuse_attention`` lets an encoder's attention read by a
    static quantized layer write that layer's int8/fp8 input (``fusion.attention_quant``; False
    keeps SDPA and the layer's quantize pass). All default to the ``PipelineOptions`` given to
    ``prepare`` (all on); ``qfuse.save`` records the options and ``qfuse.load`` replays them.
    ``per_token`` names layers of a static model that quantize their input per token at run
    time instead (as ``prepare``'s ``layer_configs`` with a dynamic QConfig would; their
    producers then hand them float): what ``auto_fallback(fallback="per-token")`` moves.
    Raises ``CalibrationError``
    (naming the layer) if a quantized layer saw no calibration data or only zeros. See
    ``qfuse.prepare`` for a full example.
    """
    qat_state = get_state(prepared)
    if qat_state is not None and qat_state.stage == "qat":
        # A QAT model converts through the PTQ path: qfuse.flows.qat.lower hands back a prepared
        # model with QAT's learned scales.

        prepared, notes = lower(prepared, notes, keep_float)
        inplace = True
    state = _state(prepared)
    keep_float = dict(keep_float or {})
    layer_dtypes = dict(layer_dtypes or {})
    notes = dict(notes or {})
    per_token = list(per_token or ())
    named = set(keep_float) | set(layer_dtypes) | set(notes) | set(per_token)
    unknown = sorted(named - {c.name for c in state.chains})
    if unknown:
        raise QFuseError(
            f"keep_float/layer_dtypes/notes/per_token name layers that are not fusible chains: "
            f"{unknown}; use the names in qfuse.summary(prepared)."
        )
    if per_token:
        state = _with_per_token(state, per_token)
    bad = {n: d for n, d in layer_dtypes.items() if d not in QUANT_NAMES}
    if bad:
        raise UnsupportedError(
            f"layer_dtypes {bad}: a layer is quantized to torch.int8 or torch.float8_e4m3fn "
            "(use keep_float to leave it in float)."
        )
    if output not in ("graph", "model"):
        raise UnsupportedError(f"output={output!r}: use 'graph' or 'model'.")
    options = _options(state, fuse_norms=fuse_norms, fuse_pools=fuse_pools,
                       fuse_attention=fuse_attention)
    if output == "model":
        return _convert_model(prepared, state, keep_float, layer_dtypes, notes, inplace)
    with warnings.catch_warnings():  # torch's pytree spec pickling warns on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        gm = prepared if inplace else copy.deepcopy(prepared)
    if not inplace:
        # Inference artefact: float parameters that remain (LayerNorm, embeddings) need no grad,
        # and torch.compile(fullgraph=True) of the fused ops (no autograd formula) requires that.
        # In place, the parameters are shared with the user's float model: leave them alone.
        gm.requires_grad_(False)
    state = copy.copy(state) if not inplace else state
    nodes = {n.name: n for n in gm.graph.nodes}
    observers = state.observers
    chains = [c for c in state.chains if c.name not in keep_float]
    dtypes = {c.name: layer_dtypes.get(c.name, state.config.dtype) for c in chains}
    # GPTQ reads the statistics on the caller's prepared model (its cache survives this copy).
    hessians = {
        c.name: prepared.get_submodule(state.hessians[c.name])
        for c in chains
        if c.name in state.hessians
    }
    plan = LayerPlan(gm, state, chains, observers, dtypes, hessians, fold_norms=True)
    plan.write_norm_weights(gm)  # SmoothQuant's factors folded into RMSNorm weights
    # anchors read their observers again
    remove_observers(gm, set(state.hessians.values()) | set(state.samples.values()))

    readers_of: dict[str, list[Chain]] = {}
    residual_of: dict[str, list[Chain]] = {}
    for chain in chains:
        readers_of.setdefault(chain.input, []).append(chain)
        if chain.residual is not None:
            residual_of.setdefault(chain.residual, []).append(chain)
    four_bit = state.config.weight_bits == 4  # 4-bit layers take and give float
    handoff = {
        c.name: ([], []) if four_bit else
        _handoff_readers(c, readers_of, residual_of, nodes, observers, plan)
        for c in chains
    }
    producers = {r.name: c.name for c in chains for r in handoff[c.name][0]}
    residual_from = {r.name: c.name for c in chains for r in handoff[c.name][1]}

    remove_observers(gm, observers.values())  # every anchor reads its real producer again
    modules, layers, paths = {}, [], module_paths(state.chains)
    for chain in chains:
        readers, res_readers = handoff[chain.name]
        float_dtype = nodes[chain.output].meta["val"].dtype
        out_qparams = plan.x_qparams[readers[0].name] if readers else None
        out_dtype = torch.int8 if readers else float_dtype
        res_qparams = None
        if chain.name in residual_from:  # the residual's writer requantized it for its readers
            res_qparams = plan.x_qparams[handoff[residual_from[chain.name]][0][0].name]
        modules[chain.name] = build(
            chain, state.config, plan, out_qparams, chain.name in producers, out_dtype,
            res_qparams,
        )
        layer_notes = []
        if chain.name in state.smoothed:
            layer_notes.append(plan.smoothquant_note(chain.name, state.smoothquant))
        if chain.name in state.hessians:
            layer_notes.append(state.gptq.describe())
        if chain.name in notes:
            layer_notes.append(notes[chain.name])
        if chain.name in residual_from:
            layer_notes.append(f"residual quantized from {residual_from[chain.name]}")
        layers.append(
            record(
                chain,
                modules[chain.name],
                paths[chain.name],
                producers.get(chain.name),
                readers,
                layer_notes,
                res_readers,
            )
        )
    fused = run_fused(gm, state.chains, modules, options)
    pooled = fused.results.get("fuse_pools") or {}
    for rec in layers:  # the records were written before the pool pass changed these layers
        if rec.name in pooled:
            pool, readers = pooled[rec.name]
            rec.output = f"{rec.precision} to {', '.join(readers)} through {pool}"
        for producer, (pool, readers) in pooled.items():
            if rec.name in readers:
                rec.input = f"{rec.precision} from {producer} through {pool}"
            elif f"{rec.name} (residual)" in readers:
                rec.note = "; ".join(filter(None, [rec.note, f"residual quantized from {producer}"
                                                  f" through {pool}"]))
    from_norm = {**(fused.results.get("fuse_norms") or {}),
                 **(fused.results.get("fuse_attention") or {})}
    for rec in layers:
        if rec.name in from_norm:
            rec.input = f"{rec.precision} from {from_norm[rec.name]}"
    kept = [
        Skipped(c.name, c.kind, f"kept float: {keep_float[c.name]}")
        for c in state.chains
        if c.name in keep_float
    ]
    add_runtime_guards(gm)  # input dtype/device checks, NaN/Inf marks (fusion.guards)
    state.skipped = kept + list(state.skipped)
    state.pipeline, state.passes = options, {**state.passes, **fused.records}
    state.stage, state.layers, state.observers, state.hessians = "converted", layers, {}, {}
    state.samples = {}
    set_state(gm, state)
    return make_picklable(gm)  # torch.save / pickle of the whole module (pipeline.pickling)


def _with_per_token(state: QFuseState, names: list[str]) -> QFuseState:
    """A copy of ``state`` whose ``layer_configs`` make ``names`` dynamic (per token), ahead of
    the globs ``prepare`` was given; the prepared model's own state is left as it is."""
    config = state.config
    if config.is_dynamic or config.weight_only:
        raise UnsupportedError(
            f"per_token={names}: moves layers of a static W8A8 config to per-token activations; "
            f"this config is {'weight-only' if config.weight_only else 'already dynamic'}."
        )
    dynamic = dataclasses.replace(config, activation_granularity=PerToken())
    layer_configs = {name: dynamic for name in names}
    for pattern, cfg in (getattr(state, "layer_configs", None) or {}).items():
        layer_configs.setdefault(pattern, cfg)
    return dataclasses.replace(state, layer_configs=layer_configs)


def _options(state, **given) -> PipelineOptions:
    """The prepared model's pipeline options with convert's own (None: as prepared)."""
    options = state.pipeline if state.pipeline is not None else PipelineOptions()
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise UnsupportedError(f"{name}={value!r}: give True or False.")
    return dataclasses.replace(options, **{k: v for k, v in given.items() if v is not None})


def _convert_model(prepared, state, keep_float, layer_dtypes, notes, inplace) -> torch.nn.Module:
    chains = [c for c in state.chains if c.name not in keep_float]
    dtypes = {c.name: layer_dtypes.get(c.name, state.config.dtype) for c in chains}
    model = convert_model(prepared, state, chains, dtypes, notes, inplace)
    kept = [
        Skipped(c.name, c.kind, f"kept float: {keep_float[c.name]}")
        for c in state.chains
        if c.name in keep_float
    ]
    get_state(model).skipped[:0] = kept
    # input dtype/device checks, NaN/Inf marks where a float input can bring them (fusion.guards)
    add_module_guards(model, float_inputs_used(prepared))
    return model
