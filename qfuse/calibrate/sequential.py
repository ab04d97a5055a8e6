"""``qfuse.calibrate_sequential``: calibrate (and GPTQ-round) a prepared model one block at a
time on the GPU while the model stays on the CPU.

The prepared graph is cut into stages (``stages.py``): prefix, one per decoder/encoder layer,
tail. Each stage in turn moves its parameters and recorders to ``device`` (or, with
``weights=``, reads them there from a safetensors checkpoint: ``shards.py``), runs every batch
from the values the stages before it computed (kept on ``device``, or on the CPU with
``offload=True``), merges its statistics across ranks, rounds its GPTQ layers (spread over the
ranks), checkpoints, and goes back to the CPU. Peak GPU memory is one block plus the cached
activations of the batches, not the model.

By default the next block reads the float outputs (llm-compressor's default): a block's observers
see exactly the values a whole-model calibration shows them, so the scales, the Hessians and the
GPTQ weights are those of ``prepared(batch)`` over the same batches, bit for bit on one device.
``outputs="quantized"`` feeds it the outputs of the block as quantized (``quantized.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from qfuse.algorithms.gptq import remember, round_layer
from qfuse.calibrate import checkpoint
from qfuse.calibrate.distributed import assign, rank, share, sync_recorders
from qfuse.calibrate.quantized import quantized_twin
from qfuse.calibrate.shards import ShardedWeights
from qfuse.calibrate.stages import Stage, split_stages
from qfuse.config import PerChannel
from qfuse.errors import CalibrationError, QFuseError, UnsupportedError
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.observers.base import observers_disabled
from qfuse.observers.distributed import world_size
from qfuse.pipeline.capture import inline_grad_wrappers
from qfuse.primitives import weight_scale
from qfuse.state import get_state


def _progress(iterable, desc: str, quiet: bool, total: int | None = None, leave: bool = False):
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=leave)


def _flat_inputs(prepared: fx.GraphModule, batch) -> list:
    """``batch`` (a kwargs dict, an args tuple or one tensor) as the graph's placeholders."""
    if isinstance(batch, dict):
        args, kwargs = (), batch
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    try:
        flat = list(fx_pytree.tree_flatten_spec((args, kwargs), prepared._in_spec))
        if len(flat) != len(pytree.tree_leaves((args, kwargs))):  # e.g. an extra keyword
            raise ValueError(f"{sorted(kwargs)} holds inputs the prepared graph does not take")
        return flat
    except Exception as exc:  # pytree raises several types for a mismatched structure
        raise CalibrationError(
            f"a calibration batch does not match the inputs the model was prepared with ({exc}). "
            "Pass each batch as the example inputs were passed to qfuse.prepare: a dict of "
            "keyword arguments, a tuple of positional ones, or one tensor."
        ) from exc


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


class _OnDevice:
    """Moves one stage's parameters and recorders to ``device`` and back (the parameters get
    their original CPU storage back: calibration does not change them). Parameters on ``meta``
    are read from ``weights`` (``shards.ShardedWeights``) and go back to ``meta`` after."""

    def __init__(self, prepared, stage: Stage, device, weights: ShardedWeights | None) -> None:
        # get_attr also names submodules (torch 2.11 export's no_grad subgraphs): tensors only
        attrs = {t: attr_tensor(prepared, t) for t in dict.fromkeys(stage.params)}
        self.params = {t: v for t, v in attrs.items() if isinstance(v, torch.Tensor)}
        self.recorders = [prepared.get_submodule(t) for t in stage.recorders]
        self.home_of = {id(p): p.data for p in self.params.values()}
        self.rec_home = [r.num_batches.device for r in self.recorders]
        self.device, self.weights = device, weights

    def __enter__(self):
        meta = [p for p in self.params.values() if p.is_meta]
        if meta and self.weights is None:
            name = next(t for t, p in self.params.items() if p.is_meta)
            raise CalibrationError(
                f"{name} of the prepared model is on meta (no data); pass weights=<the "
                "checkpoint folder, its index.json or a .safetensors file> to read it from."
            )
        for p in self.params.values():
            if not p.is_meta:
                p.data = self.home_of[id(p)].to(self.device)
        self.placed = _place(self.weights, meta, self.device) if meta else []
        for r in self.recorders:
            r.to(self.device)
        return self

    def __exit__(self, *exc):
        for p in self.params.values():
            if not p.is_meta:
                p.data = self.home_of[id(p)]
        if self.placed:
            self.weights.release(self.placed)
        for r, home in zip(self.recorders, self.rec_home, strict=True):
            r.to(home)


def _place(weights: ShardedWeights, tensors, device) -> list[int]:
    """One stage's meta tensors read from the checkpoint onto ``device``."""
    return weights.place(tensors, device)


def _solved(prepared, state) -> dict:
    """Weight target -> GPTQ's cached result for it (any one, when several were asked for)."""
    out = {}
    for chain in state.chains:
        if chain.name in state.hessians:
            recorder = prepared.get_submodule(state.hessians[chain.name])
            for key, hit in recorder.solved.items():
                if key[0] == chain.name:
                    out[chain.weight] = hit
    return out


def _run(module, stage: Stage, cache: list[dict], device, offload: bool, desc: str, quiet: bool):
    """Run every batch through ``module`` (the stage's, or its quantized twin), replacing what
    it reads in the cache by what it writes for the stages after it."""
    store = torch.device("cpu") if offload else device
    with torch.no_grad():
        for env in _progress(cache, desc, quiet):
            out = module(*(_to(env[name], device) for name in stage.inputs))
            for name, value in zip(stage.outputs, out, strict=True):
                env[name] = _to(value, store)


def _prune(cache: list[dict], later: list[Stage]) -> None:
    needed = {name for s in later for name in s.inputs}
    for env in cache:
        for name in [n for n in env if n not in needed]:
            del env[name]


def round_chains(prepared: fx.GraphModule, chains, group=None) -> int:
    """GPTQ for ``chains`` of a calibrated ``prepared`` where their weights are now (the
    device), each rounded by one rank (``distributed.assign``) and cached on every rank where
    ``qfuse.convert`` looks for it (``qfuse.algorithms.gptq.round_layer``). Returns how many
    were rounded.

    Rounds with the config's dtype; SmoothQuant's layers are left to convert, which scales their
    weights first (so does a ``layer_dtypes`` override: convert rounds again for it)."""
    state = get_state(prepared)
    if state.gptq is None:
        return 0
    per_channel = isinstance(state.config.weight_granularity, PerChannel)
    dtype = state.config.dtype
    jobs = [c for c in chains if c.name in state.hessians and c.name not in state.smoothed]
    weights = [attr_tensor(prepared, c.weight).detach().float() for c in jobs]
    # GPTQ's time follows K, its column loop, and hardly N (a 4096x4096 and a 14336x4096 weight
    # take about as long; K = 14336 several times longer). Weighing by K^2 N gave one of two
    # ranks a 7B layer's gate, up and three more projections against down and one, and two
    # GPUs rounded well short of twice as fast as one.
    costs = [float(w[0].numel()) for w in weights]
    owners = assign(costs, world_size(group))
    me = rank(group)
    # Every rank rounds all of its own layers first, then the results are exchanged: a
    # broadcast after each layer would hold the other ranks at it until the owner finished,
    # and the ranks would take turns instead of rounding at the same time.
    mine = {}
    for i, (chain, weight, owner) in enumerate(zip(jobs, weights, owners, strict=True)):
        if owner == me:
            recorder = prepared.get_submodule(state.hessians[chain.name])
            scale = weight_scale(weight, dtype, per_channel)
            mine[i] = round_layer(recorder, chain.name, weight, scale, dtype, state.gptq)
    if world_size(group) > 1:
        for i, (chain, weight, owner) in enumerate(zip(jobs, weights, owners, strict=True)):
            q = share(mine.get(i), weight.shape, owner, weight.device, group)
            if owner != me:
                recorder = prepared.get_submodule(state.hessians[chain.name])
                scale = weight_scale(weight, dtype, per_channel)
                remember(recorder, chain.name, weight, scale, dtype, state.gptq, q)
    return len(jobs)


def _round_stage(prepared, stage: Stage, group) -> int:
    return round_chains(prepared, stage.chains, group)


def calibrate_sequential(
    prepared: fx.GraphModule,
    batches: Iterable,
    *,
    device: str | torch.device | None = None,
    blocks: str | None = None,
    outputs: str = "float",
    checkpoint_dir: str | None = None,
    save_hessians: bool = False,
    offload: bool = False,
    weights: str | os.PathLike | None = None,
    group=None,
    quiet: bool = False,
) -> fx.GraphModule:
    """Calibrate ``prepared`` (from ``qfuse.prepare``, on the CPU) one block at a time on
    ``device`` and GPTQ-round each block there; returns ``prepared``, ready for
    ``qfuse.convert``.

    The result equals ``for b in batches: prepared(b)`` (then convert's GPTQ) on the same device:
    every observer and Hessian sees the float values a whole-model call shows it, because each
    block's inputs are the float outputs of the block before. Only one block's parameters and
    recorders, the cached activations of all batches and GPTQ's workspace are on ``device``.

    Args:
        batches: calibration batches, each passed as ``prepared`` takes it (a kwargs dict, an
            args tuple or one tensor); iterated once.
        device: where blocks run (default: CUDA if available, else CPU).
        blocks: module path of the repeated blocks (``"model.layers"``); default: the longest
            run of numbered submodules (``stages.find_blocks``).
        outputs: what the next block is calibrated on. ``"float"``: the block's float outputs
            (llm-compressor's default; equal to whole-model calibration). ``"quantized"``: its
            outputs with its inputs fake-quantized and its weights quantized (GPTQ's, else
            round to nearest), as the converted model will feed the next block (GPTQ's paper,
            AutoGPTQ); see ``quantized.py``.
        checkpoint_dir: after each stage, its statistics and GPTQ results are written here; a
            rerun with the same arguments skips the stages found there (it recomputes their
            outputs, with recorders off) and continues.
        save_hessians: keep GPTQ's input Hessians in the checkpoints (large; see
            ``checkpoint``).
        offload: keep the cached activations on the CPU between stages (less GPU memory,
            slower).
        weights: a safetensors checkpoint (the folder ``save_pretrained`` wrote, its
            ``model.safetensors.index.json`` or one ``.safetensors`` file) holding the values of
            the prepared model's ``meta`` parameters (a model built under
            ``qfuse.calibrate.init_empty_weights()``): each stage reads its own just before it
            runs and drops them after; at the end they are put back on the CPU for convert
            (see ``shards.py``). A missing key, another shape or dtype raises ``WeightsError``
            before the first stage.
        group: a ``torch.distributed`` process group (default: the world, when initialised):
            every rank passes its own share of the batches; statistics are merged after each
            stage and GPTQ's layers spread over the ranks, so every rank ends with the same
            state (what one process over all batches would hold; see ``observers.merge``).
        quiet: no progress bars (they are off anyway when stderr is not a terminal).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        >>> x = [torch.randn(4, 8) for _ in range(2)]
        >>> prepared = qfuse.prepare(model.eval(), qfuse.QConfig.int8_static(), (x[0],),
        ...                          gptq=qfuse.GPTQ())
        >>> prepared = qfuse.calibrate_sequential(prepared, x, device="cpu", blocks="")
        >>> len(qfuse.summary(qfuse.convert(prepared)).rows)
        3
    """
    state = get_state(prepared)
    if state is None or state.stage != "prepared":
        raise QFuseError(
            "qfuse.calibrate_sequential expects the model returned by qfuse.prepare; got "
            f"{type(prepared).__name__}" + (" that is already converted." if state else ".")
        )
    if outputs not in ("float", "quantized"):
        raise UnsupportedError(f"outputs={outputs!r}: use 'float' or 'quantized'.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = ShardedWeights(prepared, state, weights) if weights is not None else None
    # torch 2.11's export wraps no_grad blocks (Llama's rotary tables) in subgraphs whose device
    # constants stay the capture device's: inline them so the blocks run on ``device``.
    inline_grad_wrappers(prepared)
    stages = split_stages(prepared, state.chains, blocks)
    if source is not None:
        model = getattr(state.source, "model", None)  # the user's model holds them too
        source.bind([prepared, *(s.module for s in stages), *([model] if model else [])])
    cache = [dict(zip(stages[0].inputs, _flat_inputs(prepared, b), strict=True)) for b in batches]
    if not cache:
        raise CalibrationError("calibrate_sequential got no batches; pass calibration batches.")
    writer = checkpoint_dir is not None and rank(group) == 0
    if checkpoint_dir is not None:
        if writer:
            checkpoint.check_manifest(checkpoint_dir, [s.name for s in stages], len(cache))
        if world_size(group) > 1:
            torch.distributed.barrier(group)
    done = checkpoint.done_stages(checkpoint_dir, len(stages))
    for i, stage in enumerate(_progress(stages, "calibrate", quiet, leave=True)):
        with _OnDevice(prepared, stage, device, source) as placed:
            recorders = dict(zip(stage.recorders, placed.recorders, strict=True))
            if i < done:
                checkpoint.load_stage(checkpoint_dir, i, recorders)
                if outputs == "float":
                    with observers_disabled(stage.module):
                        _run(
                            stage.module,
                            stage,
                            cache,
                            device,
                            offload,
                            f"{stage.name} (done)",
                            quiet,
                        )
            else:
                _run(stage.module, stage, cache, device, offload, stage.name, quiet)
                sync_recorders(placed.recorders, group)
                _round_stage(prepared, stage, group)
                if writer:
                    checkpoint.save_stage(checkpoint_dir, i, recorders, save_hessians)
            if outputs == "quantized" and stage.chains:
                twin = quantized_twin(prepared, stage)
                _run(twin, stage, cache, device, offload, f"{stage.name} (quantized)", quiet)
        _prune(cache, stages[i + 1 :])
    if checkpoint_dir is not None and world_size(group) > 1:
        torch.distributed.barrier(group)
    if source is not None:
        source.restore(_solved(prepared, state))
    return prepared
