"""One recorder's statistics across ``torch.distributed`` ranks, through its ``merge``.

Every rank gathers every rank's buffers (tensor all-gathers: NCCL or gloo), folds them in rank
order with ``Recorder.merge`` and keeps the result, so all ranks hold the same state and it equals
what one process would hold after rank 0's batches, then rank 1's, ... (exactly for MinMax, up to
float rounding for the running means, see each ``_merge_stats`` for the histograms). GPTQ's input
Hessian, the one large statistic, is all-reduced instead: the row-weighted mean is a sum.
Without an initialised process group (or with one process) nothing happens.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from qfuse.errors import CalibrationError
from qfuse.observers.base import Recorder
from qfuse.observers.hessian import InputHessian
from qfuse.observers.moving_average import MovingAverageMinMaxObserver

_MAX_DIMS = 4  # buffers are scalars, per-channel vectors, histograms and [K, K] Hessians


def world_size(group=None) -> int:
    """Processes in ``group`` (1 without an initialised process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _comm_device(group) -> torch.device:
    # NCCL moves CUDA tensors only, gloo CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    device = _comm_device(group)
    local = t.detach().to(device).contiguous()
    out = [torch.empty_like(local) for _ in range(world_size(group))]
    dist.all_gather(out, local, group=group)
    return out


def _layouts(rec: Recorder, names: list[str], group) -> torch.Tensor:
    """[ranks, 1 + buffers * (1 + _MAX_DIMS)]: batch count, then each buffer's rank and sizes."""
    row = [int(rec.num_batches)]
    for name in names:
        shape = list(rec._buffers[name].shape)
        row += [len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
    return torch.stack(_all_gather(torch.tensor(row, dtype=torch.int64), group)).cpu()


def sync(rec: Recorder, group=None) -> None:
    """Merge ``rec`` across the ranks of ``group`` (see the module docstring); every rank calls
    it, in the same order for every recorder."""
    if world_size(group) == 1:
        return
    if isinstance(rec, InputHessian):
        _sync_hessian(rec, group)
        return
    names = [n for n, b in rec._buffers.items() if b is not None]
    layouts = _layouts(rec, names, group)
    seen = [r for r in range(len(layouts)) if int(layouts[r, 0]) > 0]
    if not seen:
        return
    # Ranks that saw nothing send zeros of the first calibrated rank's shapes (all-gather needs
    # one shape) and are left out of the fold; calibrated ranks must agree on every shape.
    ref = layouts[seen[0]]
    for r in seen:
        if not torch.equal(layouts[r], ref):
            raise CalibrationError(
                f"{rec.layer_name}: ranks {seen[0]} and {r} hold statistics of different shapes "
                "(another channel count). Prepare the same model on every rank and feed batches "
                "of one layout."
            )
    gathered: dict[str, list[torch.Tensor]] = {}
    for i, name in enumerate(names):
        base = 1 + i * (1 + _MAX_DIMS)
        shape = [int(d) for d in ref[base + 1 : base + 1 + int(ref[base])]]
        mine = rec._buffers[name]
        local = mine if int(rec.num_batches) > 0 else mine.new_zeros(shape)
        gathered[name] = _all_gather(local, group)
    device = rec.num_batches.device
    merged = None
    for r in seen:
        peer = copy.copy(rec)  # shares the settings; gets rank r's buffers
        peer.__dict__["_buffers"] = {n: gathered[n][r].to(device) for n in names}
        if merged is None:
            merged = peer
        else:
            merged.merge(peer)
    for name in names:
        rec._buffers[name] = merged._buffers[name]
    if isinstance(rec, MovingAverageMinMaxObserver):
        rec.rebase()


def _sync_hessian(h: InputHessian, group) -> None:
    device = _comm_device(group)
    rows = h.num_rows.to(device).clone()
    dist.all_reduce(rows, group=group)
    if int(rows) == 0:
        return
    k = torch.tensor([h.hessian.shape[0] if int(h.num_rows) else -1], device=device)
    lo, hi = k.clone(), k.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    size = int(hi)
    if int(lo) not in (-1, size):
        raise CalibrationError(
            f"{h.layer_name}: ranks hold input Hessians of different sizes. Prepare the same "
            "model on every rank."
        )
    weight = float(h.num_rows) / float(rows)
    local = h.hessian * weight if int(h.num_rows) else torch.zeros(size, size)
    total = local.to(device, torch.float32).contiguous()
    dist.all_reduce(total, group=group)
    batches = h.num_batches.to(device).clone()
    dist.all_reduce(batches, group=group)
    h.hessian = total.to(h.num_rows.device)
    h.num_rows = rows.to(h.num_rows.device)
    h.num_batches = batches.to(h.num_rows.device)
    h.solved.clear()
