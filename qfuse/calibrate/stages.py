"""A prepared graph cut into stages that run one after another: the prefix (embeddings, masks,
rotary tables), one stage per repeated block (a transformer's decoder or encoder layers), and the
tail (final norm, head).

Every node of ``qfuse.prepare``'s graph keeps the ``nn_module_stack`` export recorded; a node
belongs to block ``i`` when a module on its stack is ``<blocks>.<i>``. Nodes without a block
(observers, GPTQ's Hessians, the slices of a merged Q/K/V) run in the stage of their latest
input, nodes after the last block's in the tail, parameters are read by every stage that uses
them. Each stage is an ``fx.GraphModule`` over the very same parameters and observer modules as
the prepared graph, taking the values earlier stages computed and returning those later stages
read: running the stages in order runs the prepared graph's nodes in its own order on the same
inputs, so the observers see what one whole-model call would show them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import fx

from qfuse.errors import UnsupportedError
from qfuse.fusion.patterns import Chain
from qfuse.observers.base import Recorder
from qfuse.shapes import GUARDS

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _check_only(node: fx.Node) -> bool:
    """Export's input guards and tensor-metadata asserts: checks with no result, left out of the
    stages. A stage runs on its own device with cached inputs, where torch 2.11's guards (which
    read every placeholder, None ones too, and strides of rank slices) and its recorded capture
    device (``_assert_tensor_metadata(device=cpu)``) would fail on a correct run; the whole model
    still checks its inputs when called."""
    if node.users:
        return False
    return (node.op == "call_module" and node.target == GUARDS) or (
        node.op == "call_function" and node.target is _ASSERT_METADATA
    )


_INDEXED = re.compile(r"^(?:(?P<parent>.+)\.)?(?P<index>\d+)$")


@dataclass
class Stage:
    """One stage: ``module(*inputs)`` returns the tuple of ``outputs`` (node names)."""

    name: str
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    params: list[str] = field(default_factory=list)  # get_attr targets it reads
    recorders: list[str] = field(default_factory=list)  # observer / Hessian module targets
    chains: list[Chain] = field(default_factory=list)  # chains whose anchor runs here


def _stack_paths(node: fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def find_blocks(gm: fx.GraphModule) -> str:
    """The module path of the container with the most numbered submodules (``model.layers``):
    a transformer's decoder/encoder layers; ``""`` for the model's own numbered children.

    Raises ``UnsupportedError`` when the graph has no numbered submodules."""
    counts: Counter[str] = Counter()
    seen: set[str] = set()
    for node in gm.graph.nodes:
        for path in _stack_paths(node):
            m = _INDEXED.match(path)
            if m and path not in seen:
                seen.add(path)
                counts[m.group("parent") or ""] += 1
    if not counts:
        raise UnsupportedError(
            "sequential calibration found no repeated blocks (numbered submodules such as "
            "model.layers.0, model.layers.1) in the captured graph; name the container with "
            "blocks='...' or calibrate the whole model with qfuse.prepare."
        )
    best = max(counts.values())
    return next(parent for parent, n in counts.items() if n == best)


def _block_of(node: fx.Node, blocks: str) -> int | None:
    prefix = f"{blocks}." if blocks else ""
    for path in _stack_paths(node):
        if path.startswith(prefix):
            head = path[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def split_stages(gm: fx.GraphModule, chains: list[Chain], blocks: str | None = None) -> list[Stage]:
    """``gm`` (from ``qfuse.prepare``) as prefix, one stage per block of ``blocks`` (found by
    ``find_blocks`` when None) and tail; empty prefix/tail stages are left out."""
    blocks = blocks if blocks is not None else find_blocks(gm)
    nodes = list(gm.graph.nodes)
    labels = {n: _block_of(n, blocks) for n in nodes}
    indices = sorted({b for b in labels.values() if b is not None})
    if not indices:
        containers = sorted(
            {
                m.group("parent") or ""
                for n in nodes
                for p in _stack_paths(n)
                if (m := _INDEXED.match(p))
            }
        )
        raise UnsupportedError(
            f"blocks={blocks!r} matches no module of the captured graph; numbered containers "
            f"in it: {containers or 'none'}."
        )
    tail = len(indices)
    order = {b: i for i, b in enumerate(indices)}  # block index -> stage position (0-based)
    last_block = max(i for i, n in enumerate(nodes) if labels[n] is not None)
    stage_of: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op == "get_attr":
            continue
        if node.op == "placeholder":
            stage_of[node] = -1
        elif node.op == "output" or (labels[node] is None and i > last_block):
            stage_of[node] = tail
        elif labels[node] is not None:
            stage_of[node] = order[labels[node]]
        else:
            stage_of[node] = max(
                [stage_of[a] for a in node.all_input_nodes if a.op != "get_attr"], default=-1
            )
        for arg in node.all_input_nodes:
            if arg.op != "get_attr" and stage_of[arg] > stage_of[node]:
                raise UnsupportedError(
                    f"node {node.name} (block {labels[node]}) reads {arg.name}, computed in a "
                    f"later block of {blocks!r}: the blocks do not run one after another, so "
                    "they cannot be calibrated one at a time. Calibrate with qfuse.prepare."
                )
    names = ["prefix", *(f"{blocks}.{b}" if blocks else str(b) for b in indices), "tail"]
    members: dict[int, list[fx.Node]] = {s: [] for s in range(-1, tail + 1)}
    for node in nodes:
        if node.op != "get_attr" and not _check_only(node):
            members[stage_of[node]].append(node)
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                last_use[arg] = max(last_use.get(arg, -1), stage_of[node])
    anchors = {c.anchor: c for c in chains}
    stages = []
    for s in range(-1, tail + 1):
        if not members[s] or (s in (-1, tail) and all(n.op == "output" for n in members[s])):
            continue
        stage = _build_stage(gm, names[s + 1], members[s], stage_of, last_use, s)
        stage.chains = [anchors[n.name] for n in members[s] if n.name in anchors]
        stages.append(stage)
    return stages


def _build_stage(gm, name, members, stage_of, last_use, s) -> Stage:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    params: list[str] = []
    recorders: list[str] = []

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op == "get_attr":
                env[arg] = graph.get_attr(arg.target)
                params.append(arg.target)
            else:  # computed by an earlier stage
                env[arg] = graph.placeholder(arg.name)
                inputs.append(arg.name)
        return env[arg]

    body = [n for n in members if n.op != "output"]
    for node in body:  # graph order: a same-stage input is in env before its reader
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            inputs.append(node.name)
            continue
        env[node] = graph.node_copy(node, lookup)
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), Recorder):
            recorders.append(node.target)
    outputs = [n.name for n in body if last_use.get(n, -1) > s]
    by_name = {n.name: n for n in body}
    graph.output(tuple(env[by_name[o]] for o in outputs))
    # Placeholders must come first in an fx graph; lookup created them where first read.
    for ph in reversed([n for n in graph.nodes if n.op == "placeholder"]):
        first = next(iter(graph.nodes))
        if first is not ph:
            first.prepend(ph)
    module = fx.GraphModule(gm, graph, class_name=f"Stage_{name.replace('.', '_')}")
    return Stage(name, module, inputs, outputs, params, recorders)
