"""Run the registered passes of one stage, fresh or as a replay of recorded ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from qfuse.fusion.gemms import leftover_gemms
from qfuse.fusion.patterns import Chain, Skipped, find_chains
from qfuse.pipeline.options import PipelineOptions
from qfuse.pipeline.passes import CAPTURE, FUSED, PASSES, PassContext


@dataclass
class StageRun:
    """What one stage did: each pass's result (for the flows) and record (saved, replayed)."""

    results: dict[str, object] = field(default_factory=dict)
    records: dict[str, list] = field(default_factory=dict)
    chains: list[Chain] = field(default_factory=list)  # capture stage: the chains found after it
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def merged(self) -> list[list[str]]:
        """Every merged group (gate/up pairs, then Q/K/V groups), as ``QFuseState.merged``."""
        return [g for name in ("merge_gated", "merge_siblings") for g in self.records.get(name, [])]


def _run(ctx: PassContext, stage: str) -> StageRun:
    run = StageRun()
    for graph_pass in PASSES:
        if graph_pass.stage != stage or not graph_pass.enabled(ctx.options, ctx.training):
            continue
        result = graph_pass.apply(ctx)
        run.results[graph_pass.name] = result
        record = graph_pass.record(ctx, result)
        if record is not None:
            run.records[graph_pass.name] = record
    return run


def run_capture(
    gm: fx.GraphModule,
    options: PipelineOptions,
    *,
    training: bool = False,
    replay: dict[str, list] | None = None,
) -> StageRun:
    """Run the capture-stage passes on a freshly captured ``gm`` (in place), then find its
    chains. ``training``: a train-mode (QAT) graph. ``replay``: records of an earlier run (a
    saved file, QAT's train-mode graph) whose merges are repeated exactly; compare the returned
    records with them (``mismatches``)."""
    run = _run(PassContext(gm, options, training, replay=replay), CAPTURE)
    run.chains, run.skipped = find_chains(gm)
    run.skipped += leftover_gemms(gm)
    return run


def run_fused(
    gm: fx.GraphModule,
    chains: list[Chain],
    modules: dict[str, nn.Module],
    options: PipelineOptions,
) -> StageRun:
    """Fuse ``chains`` into ``modules`` (by chain name; chains without one stay float), then run
    the fused-stage passes, in place."""
    return _run(PassContext(gm, options, chains=chains, modules=modules), FUSED)


def mismatches(
    records: dict[str, list], recorded: dict[str, list], stage: str
) -> list[tuple[str, list, list]]:
    """``(pass name, this run's record, the recorded one)`` for each pass of ``stage`` whose
    records differ; a pass missing from ``recorded`` (it did not run there) is not compared."""
    out = []
    for graph_pass in PASSES:
        name = graph_pass.name
        if graph_pass.stage != stage or name not in recorded:
            continue
        mine, theirs = records.get(name, []), recorded[name]
        if _canonical(mine) != _canonical(theirs):
            out.append((name, mine, theirs))
    return out


def _canonical(record: list) -> list:
    return sorted(map(repr, (list(r) if isinstance(r, (list, tuple)) else r for r in record)))


__all__ = ["CAPTURE", "FUSED", "StageRun", "mismatches", "run_capture", "run_fused"]
