"""Host-side state the tiled kernels' launches share: the GPU's multiprocessor count (persistent
grids, split-K rules) and split-K's per-tile arrival counters (``epilogue.split_k_reduce``)."""

from __future__ import annotations

import functools

import torch

# One self-resetting counter per output tile and device (split-K); 1 MiB of int32 covers every
# grid used here (at most ~ 16k tiles). Launches on one device are stream-ordered in qfuse.
_LOCKS: dict[torch.device, torch.Tensor] = {}


def split_k_locks(device: torch.device, tiles: int, tracing: bool) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters on ``device``; the kernels leave them zeroed.
    ``tracing`` (a compiled graph, or a CUDA-graph capture, owns its buffers): fresh zeros."""
    if tracing:
        return torch.zeros(tiles, device=device, dtype=torch.int32)
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < tiles:
        locks = torch.zeros(max(tiles, 1 << 18), device=device, dtype=torch.int32)
        _LOCKS[device] = locks
    return locks


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of CUDA ``device`` (its index, or the current device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
