"""Sequential calibration over ``torch.distributed`` ranks: each rank calibrates its own share of
the batches, the statistics of every stage are merged (``qfuse.observers.distributed.sync``),
and the stage's GPTQ layers are spread over the ranks, each result sent to every rank.

Without an initialised process group (or with one process) everything runs locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qfuse.observers.distributed import _comm_device, sync, world_size


def rank(group=None) -> int:
    return dist.get_rank(group) if world_size(group) > 1 else 0


def sync_recorders(recorders, group=None) -> None:
    """Merge each recorder across ranks, in one order on every rank."""
    for rec in recorders:
        sync(rec, group)


def assign(costs: list[float], ranks: int) -> list[int]:
    """The rank that rounds each job: largest first, each to the least-loaded rank (GPTQ's cost
    grows with ``K``, its column loop: a 7B layer's down projection weighs 2.7 of the others).

    Example:
        >>> assign([1.0, 4.0, 1.0, 2.0], 2)
        [1, 0, 1, 1]
    """
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: -costs[j]):
        r = min(range(ranks), key=lambda i: load[i])
        owner[job] = r
        load[r] += costs[job]
    return owner


def share(result: torch.Tensor | None, shape, owner: int, device, group=None) -> torch.Tensor:
    """Rank ``owner``'s ``result`` (float32, ``shape``) on every rank."""
    if world_size(group) == 1:
        return result
    comm = _comm_device(group)
    if rank(group) == owner:
        buf = result.detach().to(comm, torch.float32).contiguous()
    else:
        buf = torch.empty(shape, dtype=torch.float32, device=comm)
    dist.broadcast(buf, src=dist.get_global_rank(group, owner) if group else owner, group=group)
    return buf.to(device)
