"""Every graph pass of qfuse, registered once: what it matches and rewrites, the option that turns
it on, what it records for ``save`` and how a recorded run is replayed.

Two stages. ``capture`` passes rewrite the float graph before chains are found (BatchNorm folding,
the gate/up and Q/K/V merges): ``prepare``, ``prepare_qat``, QAT's lowering and ``load`` run them.
``fused`` passes rewrite the graph once chains are fused modules (chain fusion, quantized pools
and norms, inference clean-ups): ``convert`` and ``load`` run them. A pass's record (JSON: layer
names) goes into the state, the ``qfuse.save`` file and the QAT record; a replay (``load``, QAT's
lowering) hands the recorded merges back as ``only`` so that exactly those groups merge, and
compares every record with the saved one. A new model family adds one ``register(GraphPass(...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from torch import fx, nn

from qfuse.errors import QFuseError
from qfuse.fusion.attention_quant import fuse_attention_quant
from qfuse.fusion.bn_fold import fold_batchnorm
from qfuse.fusion.eager_calls import eager_rewrites
from qfuse.fusion.gated import merge_gated_linears
from qfuse.fusion.norm_quant import fuse_layernorm_quant
from qfuse.fusion.patterns import Chain
from qfuse.fusion.pool_quant import fuse_maxpool_quant
from qfuse.fusion.rewrite import fuse_chains
from qfuse.fusion.siblings import merge_sibling_linears
from qfuse.ops.pool import max_pool2d_call
from qfuse.pipeline.capture import inline_grad_wrappers
from qfuse.pipeline.options import PipelineOptions

CAPTURE, FUSED = "capture", "fused"


@dataclass
class PassContext:
    """What a pass sees: the graph, the options, the mode, and for the fused stage the chains
    and their fused modules. ``replay`` holds the records being replayed (pass name -> record)."""

    gm: fx.GraphModule
    options: PipelineOptions
    training: bool = False
    chains: list[Chain] = field(default_factory=list)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    replay: dict[str, list] | None = None

    def recorded(self, name: str):
        """The record of pass ``name`` being replayed, or None (a fresh run)."""
        return None if self.replay is None else self.replay.get(name)


@dataclass(frozen=True)
class GraphPass:
    """One registered pass.

    ``apply(ctx)`` matches and rewrites ``ctx.gm`` in place and returns what it did (read by the
    flows: convert's summary notes); ``record(ctx, result)`` is the JSON-able list saved and
    compared on replay (None: nothing to compare). ``option`` names the ``PipelineOptions`` field
    that turns the pass on (None: always on). ``in_training=False``: a train-mode (QAT) capture
    skips it (QAT simulates it some other way).
    """

    name: str
    stage: str
    apply: Callable[[PassContext], object]
    record: Callable[[PassContext, object], list | None] = lambda ctx, result: None
    option: str | None = None
    in_training: bool = True

    def enabled(self, options: PipelineOptions, training: bool = False) -> bool:
        if training and not self.in_training:
            return False
        return self.option is None or getattr(options, self.option)


PASSES: list[GraphPass] = []


def register(graph_pass: GraphPass) -> GraphPass:
    """Add ``graph_pass`` to the pipeline, after the passes of its stage registered before it."""
    if any(p.name == graph_pass.name for p in PASSES):
        raise QFuseError(f"a graph pass named {graph_pass.name!r} is already registered.")
    if graph_pass.stage not in (CAPTURE, FUSED):
        raise QFuseError(
            f"pass {graph_pass.name}: stage {graph_pass.stage!r}; use {CAPTURE!r} or {FUSED!r}."
        )
    known = {f.name for f in fields(PipelineOptions)}
    if graph_pass.option is not None and graph_pass.option not in known:
        raise QFuseError(
            f"pass {graph_pass.name}: option {graph_pass.option!r} is not a "
            f"PipelineOptions field ({sorted(known)})."
        )
    PASSES.append(graph_pass)
    return graph_pass


def _groups(ctx, result) -> list:
    return [list(g) for g in result]


def _sorted(ctx, result) -> list:
    return sorted(result)


def _pooled(ctx, result) -> list[str]:
    """The fused convs whose output a max-pool reads quantized (producer paths)."""
    return sorted(
        n.args[0].target
        for n in ctx.gm.graph.nodes
        if n.op == "call_function" and n.target is max_pool2d_call
    )


def _on_graph(rewrite: Callable[[fx.GraphModule], object]) -> Callable[[PassContext], object]:
    """The ``apply`` of a pass that needs nothing but the graph."""
    return lambda ctx: rewrite(ctx.gm)


def _merge(name: str, merge: Callable) -> GraphPass:
    """A capture-stage merge: switched by the option of its own name, and on replay merging
    exactly the groups it recorded."""
    return GraphPass(
        name,
        CAPTURE,
        apply=lambda ctx: merge(ctx.gm, ctx.recorded(name)),
        record=_groups,
        option=name,
    )


# Not on a train-mode graph: QAT trains Conv2d + BatchNorm on simulated folded weights
# (qfuse.flows.qat.conv_bn), and its lowering folds them with the trained statistics.
register(
    GraphPass(
        "fold_batchnorm",
        CAPTURE,
        apply=_on_graph(fold_batchnorm),
        record=lambda ctx, result: list(result),
        in_training=False,
    )
)
register(_merge("merge_gated", merge_gated_linears))
register(_merge("merge_siblings", merge_sibling_linears))
register(
    GraphPass("fuse_chains", FUSED, apply=lambda ctx: fuse_chains(ctx.gm, ctx.chains, ctx.modules))
)
register(
    GraphPass("fuse_pools", FUSED, _on_graph(fuse_maxpool_quant), _pooled, option="fuse_pools")
)
register(
    GraphPass("fuse_norms", FUSED, _on_graph(fuse_layernorm_quant), _sorted, option="fuse_norms")
)
# Inference clean-ups: torch 2.11 export's no_grad subgraphs, then view ops as tensor methods and
# no all-ones masks (eager host time).
register(GraphPass("inline_grad_wrappers", FUSED, _on_graph(inline_grad_wrappers)))
register(GraphPass("eager_rewrites", FUSED, _on_graph(eager_rewrites)))
# After eager_rewrites: the fused attention reads the mask through drop_full_mask as SDPA did.
register(
    GraphPass(
        "fuse_attention", FUSED, _on_graph(fuse_attention_quant), _sorted, option="fuse_attention"
    )
)
