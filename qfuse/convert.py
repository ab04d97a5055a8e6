"""``qfuse.convert``: turn a calibrated prepared model into fused quantized modules.

Each chain becomes one call_module node (QLinear/QConv2d) at the chain's module path. A chain
whose output is read only by other quantized chains hands them int8 (requantized in its epilogue
with their input scale); every other output is float in the model's dtype.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

import torch
from torch import fx

from qfuse.errors import QFuseError
from qfuse.fusion.patterns import Chain, Skipped
from qfuse.fusion.rewrite import fuse_chains, module_paths, remove_observers
from qfuse.nn import QConv2d, QLinear
from qfuse.state import STATE_ATTR, LayerRecord, QFuseState


def _state(model) -> QFuseState:
    state = getattr(model, STATE_ATTR, None)
    if state is None or state.stage != "prepared":
        raise QFuseError(
            "qfuse.convert expects the model returned by qfuse.prepare (and calibrated); "
            f"got {type(model).__name__}" + (" that is already converted." if state else ".")
        )
    return state


def _consumers(chain: Chain, chains_by_input: dict[str, list[Chain]], nodes, observers) -> list:
    """The chains reading this chain's output, if they are its only readers; else []."""
    out = nodes[chain.output]
    obs_name = observers.get(chain.output)
    if obs_name is None or len(out.users) != 1:
        return []
    (obs_node,) = out.users
    if obs_node.op != "call_module" or obs_node.target != obs_name:
        return []
    readers = chains_by_input.get(chain.output, [])
    if {u.name for u in obs_node.users} != {r.anchor for r in readers}:
        return []
    return readers


def _build(gm, chain: Chain, config, x_qparams, out_qparams, input_quantized, out_dtype):
    weight = (
        gm.get_parameter(chain.weight)
        if chain.weight in dict(gm.named_parameters())
        else (gm.get_buffer(chain.weight))
    )
    bias = None
    if chain.bias is not None:
        params = dict(gm.named_parameters())
        bias = params[chain.bias] if chain.bias in params else gm.get_buffer(chain.bias)
    common = dict(
        x_scale=x_qparams[0],
        x_zero_point=x_qparams[1],
        per_channel=config.weight_granularity.__class__.__name__ == "PerChannel",
        activation=chain.activation,
        input_quantized=input_quantized,
        out_scale=out_qparams[0] if out_qparams else None,
        out_zero_point=out_qparams[1] if out_qparams else None,
        out_dtype=out_dtype,
    )
    if chain.kind == "linear":
        return QLinear.from_float(weight, bias, **common)
    return QConv2d.from_float(weight, bias, **chain.conv, **common)


def convert(
    prepared: fx.GraphModule,
    inplace: bool = False,
    keep_float: Mapping[str, str] | None = None,
) -> fx.GraphModule:
    """Replace every calibrated chain of ``prepared`` with its fused quantized module.

    ``keep_float`` maps layer names to the reason they stay in float (mixed precision, e.g. from
    ``qfuse.auto_fallback``); ``qfuse.summary`` shows the reason. Raises ``CalibrationError``
    (naming the layer) if a quantized layer saw no calibration data or only zeros. See
    ``qfuse.prepare`` for a full example.
    """
    state = _state(prepared)
    keep_float = dict(keep_float or {})
    unknown = sorted(set(keep_float) - {c.name for c in state.chains})
    if unknown:
        raise QFuseError(
            f"keep_float names layers that are not fusible chains of this model: {unknown}; "
            "use the names in qfuse.summary(prepared)."
        )
    with warnings.catch_warnings():  # torch's pytree spec pickling warns on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        gm = prepared if inplace else copy.deepcopy(prepared)
    state = copy.copy(state) if not inplace else state
    nodes = {n.name: n for n in gm.graph.nodes}
    observers = state.observers
    chains = [c for c in state.chains if c.name not in keep_float]
    needed = {c.input for c in chains} | {c.output for c in chains if c.output in observers}
    qparams = {
        src: gm.get_submodule(name).calculate_qparams()
        for src, name in observers.items()
        if src in needed
    }

    chains_by_input: dict[str, list[Chain]] = {}
    for chain in chains:
        chains_by_input.setdefault(chain.input, []).append(chain)
    consumers = {c.name: _consumers(c, chains_by_input, nodes, observers) for c in chains}
    producers = {r.name: c.name for c in chains for r in consumers[c.name]}

    # Observers go first, so every anchor reads its real producer again.
    remove_observers(gm, observers.values())
    modules, layers, paths = {}, [], module_paths(state.chains)
    for chain in chains:
        readers = consumers[chain.name]
        float_dtype = nodes[chain.output].meta["val"].dtype
        out_qparams = qparams[chain.output] if readers else None
        out_dtype = torch.int8 if readers else float_dtype
        modules[chain.name] = _build(
            gm,
            chain,
            state.config,
            qparams[chain.input],
            out_qparams,
            chain.name in producers,
            out_dtype,
        )
        layers.append(
            LayerRecord(
                name=paths[chain.name],
                pattern=chain.pattern,
                kind=chain.kind,
                precision="int8",
                input=f"int8 from {producers[chain.name]}"
                if chain.name in producers
                else "float → int8 in prologue",
                output=f"int8 to {', '.join(r.name for r in readers)}"
                if readers
                else str(float_dtype).replace("torch.", ""),
            )
        )
    fuse_chains(gm, state.chains, modules)
    kept = [
        Skipped(c.name, c.kind, f"kept float: {keep_float[c.name]}")
        for c in state.chains
        if c.name in keep_float
    ]
    state.skipped = kept + list(state.skipped)
    state.stage, state.layers, state.observers = "converted", layers, {}
    setattr(gm, STATE_ATTR, state)
    return gm
