"""``qfuse.prepare``: capture, fold BatchNorm, find fusible chains, insert observers."""

from __future__ import annotations

import torch
from torch import fx, nn

from qfuse.capture import capture
from qfuse.config import QConfig
from qfuse.errors import UnsupportedError
from qfuse.fusion.bn_fold import fold_batchnorm
from qfuse.fusion.patterns import find_chains
from qfuse.observers import make_observer
from qfuse.state import STATE_ATTR, QFuseState


def _observer_name(node_name: str) -> str:
    return f"qfuse_observer_{node_name}"


def prepare(
    model: nn.Module,
    config: QConfig,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
) -> fx.GraphModule:
    """Capture ``model`` and insert observers in front of every fusible Linear/Conv2d chain.

    Calibrate by calling the returned module on representative batches, then ``qfuse.convert``.
    The float model is not modified (BatchNorm is folded in the captured copy).

    Example:
        >>> import torch, qfuse
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> [row["pattern"] for row in qfuse.summary(qmodel).rows]
        ['Linear→ReLU', 'Linear']
    """
    if not isinstance(config, QConfig):
        raise UnsupportedError(f"config must be a qfuse.QConfig, got {type(config).__name__}.")
    if config.dtype != torch.int8 or config.is_dynamic:
        raise UnsupportedError(
            "qfuse.prepare implements static int8 (QConfig.int8_static / int8_static_asymmetric) "
            "so far; fp8 and dynamic activation quantization are not implemented yet."
        )
    gm = capture(model, example_inputs, example_kwargs, dynamic_shapes)
    folded = fold_batchnorm(gm)
    chains, skipped = find_chains(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    observers: dict[str, str] = {}
    for chain in chains:
        if chain.input in observers:
            continue
        readers = [c.name for c in chains if c.input == chain.input]
        obs = make_observer(
            config.observer,
            symmetric=config.symmetric,
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
    gm.recompile()
    setattr(gm, STATE_ATTR, QFuseState(config, "prepared", chains, skipped, observers,
                                       folded_batchnorms=folded))
    return gm
