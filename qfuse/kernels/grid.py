"""Host-side state the tiled kernels' launches share: the GPU's multiprocessor count (persistent
grids, split-K rules), split-K's per-tile arrival counters (``epilogue.split_k_reduce``), and
whether launches are programmatic dependent launches (``pdl``)."""

from __future__ import annotations

import functools
import os

import torch

from qfuse.kernels.common import INTERPRETED

# Programmatic dependent launch (sm_90+): a model step is a chain of short kernels, and the gap
# between one kernel's last program and the next one's first is a large part of each at decode
# and encoder sizes. A kernel launched with the attribute may start while the one before it
# drains; it waits (``common.pdl_wait``) before touching anything that kernel may write, and the
# decode GEMMs issue their first weight loads before waiting. ``QFUSE_PDL=0`` turns it off (an
# A/B switch, read per launch).
PDL_ENABLED = os.environ.get("QFUSE_PDL", "1") != "0"


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl(device: torch.device) -> bool:
    """Whether GEMM launches on ``device`` are programmatic dependent launches."""
    if not PDL_ENABLED or INTERPRETED or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None
                       else torch.cuda.current_device()) >= 9


def pdl_options(args: dict) -> dict:
    """Launch options beyond the schedule's for a kernel bound with ``args``: the
    programmatic-dependent-launch attribute where its ``PDL`` constexpr is set."""
    return {"launch_pdl": True} if args.get("PDL") else {}

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
