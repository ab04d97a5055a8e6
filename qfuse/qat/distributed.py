"""Observer statistics across ``torch.distributed`` ranks: every rank converts to the same scales.

Each rank calibrates (or trains) on its own shard; ``sync_observers`` merges the statistics with
all-reduces and leaves identical state on every rank:

- MinMax: the global min and max (exactly what one observer over all shards would hold);
- moving-average MinMax: the mean of the ranks' averages (QAT syncs every step, so each step
  moves the shared average by the mean of the ranks' batch ranges);
- percentile: the sums of per-batch percentiles and the batch counts (the mean over all batches);
- histograms: each rank's histogram re-binned onto the global [min, max], then summed;
- GPTQ's input Hessian: the row-weighted mean of the ranks' ``E[x x^T]``.

Without an initialised process group (or with one process) every function is a no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qfuse.errors import UnsupportedError
from qfuse.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PercentileObserver,
)
from qfuse.observers.base import Recorder
from qfuse.observers.hessian import InputHessian

_SUM, _MIN, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX


def world_size(group=None) -> int:
    """Processes in ``group`` (1 without an initialised process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _reduced(t: torch.Tensor, op, group) -> torch.Tensor:
    # NCCL reduces CUDA tensors only, gloo CPU ones; reduce a copy on the backend's device.
    device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(group) else "cpu"
    out = t.detach().to(device=device, copy=True).contiguous()
    dist.all_reduce(out, op=op, group=group)
    return out.to(t.device)


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _sync_minmax(obs: MinMaxObserver, group) -> None:
    n = world_size(group)
    if int(_reduced(obs.num_batches, _SUM, group)) == 0:
        return
    if isinstance(obs, MovingAverageMinMaxObserver):
        _check_same_shape(obs, obs.min_val, group)
        obs.min_val = _reduced(obs.min_val, _SUM, group) / n
        obs.max_val = _reduced(obs.max_val, _SUM, group) / n
    else:
        obs.min_val = _reduced(obs.min_val, _MIN, group)
        obs.max_val = _reduced(obs.max_val, _MAX, group)


def _check_same_shape(obs: Recorder, t: torch.Tensor, group) -> None:
    size = torch.tensor([float(t.numel())])
    lo, hi = _reduced(size, _MIN, group), _reduced(size, _MAX, group)
    if bool(lo != hi) or int(obs.num_batches) == 0:
        raise UnsupportedError(
            f"{obs.layer_name}: cannot merge this observer across ranks: some rank saw no data "
            "or a different channel count. Give every rank at least one calibration batch."
        )


def _sync_percentile(obs: PercentileObserver, group) -> None:
    _check_same_shape(obs, obs.min_sum, group)
    obs.min_sum = _reduced(obs.min_sum, _SUM, group)
    obs.max_sum = _reduced(obs.max_sum, _SUM, group)


def _sync_histogram(obs: HistogramObserver, group) -> None:
    if int(obs.num_batches) == 0:
        raise UnsupportedError(
            f"{obs.layer_name}: this rank saw no calibration data, so its histogram cannot be "
            "merged. Give every rank at least one calibration batch."
        )
    lo, hi = _reduced(obs.min_val, _MIN, group), _reduced(obs.max_val, _MAX, group)
    obs.histogram = _reduced(obs._rebinned(lo, hi), _SUM, group)
    obs.min_val, obs.max_val = lo, hi


def _sync_hessian(h: InputHessian, group) -> None:
    rows = _reduced(h.num_rows, _SUM, group)
    if int(rows) == 0:
        return
    _check_same_shape(h, h.hessian, group)
    weighted = _reduced(h.hessian * (h.num_rows.double() / rows.double()).float(), _SUM, group)
    h.hessian, h.num_rows = weighted, rows
    h.solved.clear()


def sync_observer(module: nn.Module, group=None) -> None:
    """Merge one recorder's statistics across ranks (see the module docstring)."""
    if world_size(group) == 1:
        return
    if isinstance(module, InputHessian):
        _sync_hessian(module, group)
        return
    if isinstance(module, MinMaxObserver):
        _sync_minmax(module, group)
    elif isinstance(module, PercentileObserver):
        _sync_percentile(module, group)
    elif isinstance(module, HistogramObserver):
        _sync_histogram(module, group)
    else:
        raise UnsupportedError(
            f"{getattr(module, 'layer_name', type(module).__name__)}: no cross-rank merge for "
            f"{type(module).__name__}; use minmax, moving_average_minmax, percentile or a "
            "histogram observer under torch.distributed."
        )
    module.num_batches = _reduced(module.num_batches, _SUM, group)


def sync_observers(model: nn.Module, group=None) -> int:
    """All-reduce every observer (and GPTQ input Hessian) of a prepared model across the ranks
    of ``group``, so that ``qfuse.convert`` gives the same scales on every rank. Call it on every
    rank after calibrating each on its own shard. Returns how many recorders were merged.

    Example:
        >>> import torch, qfuse
        >>> prepared = qfuse.prepare(torch.nn.Linear(4, 4), qfuse.QConfig.int8_static(),
        ...                          example_inputs=(torch.randn(2, 4),))
        >>> _ = prepared(torch.randn(2, 4))
        >>> qfuse.sync_observers(prepared)  # one process: nothing to merge
        0
    """
    if world_size(group) == 1:
        return 0
    recorders = [m for m in model.modules() if isinstance(m, Recorder)]
    for rec in recorders:
        sync_observer(rec, group)
    return len(recorders)
