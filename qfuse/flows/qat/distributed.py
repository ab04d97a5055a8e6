"""Observer statistics across ``torch.distributed`` ranks: every rank converts to the same scales.

Each rank calibrates (or trains) on its own shard; ``sync_observers`` merges the statistics and
leaves identical state on every rank. How each statistic merges is the observer's own
``merge`` (``qfuse.observers``): MinMax the global range; moving-average MinMax the average one
process would hold after rank 0's batches, then rank 1's, ...; percentile the mean over all
batches; histograms re-binned onto the global range and added; GPTQ's input Hessian the
row-weighted mean. ``qfuse.observers.distributed.sync`` moves the tensors (NCCL or gloo).

Without an initialised process group (or with one process) every function is a no-op.
"""

from __future__ import annotations

from torch import nn

from qfuse.errors import UnsupportedError
from qfuse.observers.base import Recorder
from qfuse.observers.distributed import sync, world_size

__all__ = ["sync_observer", "sync_observers", "world_size"]


def sync_observer(module: nn.Module, group=None) -> None:
    """Merge one recorder's statistics across ranks (see the module docstring)."""
    if world_size(group) == 1:
        return
    if not isinstance(module, Recorder):
        raise UnsupportedError(
            f"{getattr(module, 'layer_name', type(module).__name__)}: {type(module).__name__} is "
            "not a qfuse observer; only qfuse.observers recorders merge across ranks."
        )
    sync(module, group)


def sync_observers(model: nn.Module, group=None) -> int:
    """Merge every observer (and GPTQ input Hessian) of a prepared model across the ranks of
    ``group``, so that ``qfuse.convert`` gives the same scales on every rank. Call it on every
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
        sync(rec, group)
    return len(recorders)
