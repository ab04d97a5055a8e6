"""Calibration of models larger than the GPU: one block at a time (``calibrate_sequential``),
optionally over ``torch.distributed`` ranks, optionally reading each block's weights from a
safetensors checkpoint (``weights=``, with a model built under ``init_empty_weights``)."""

from qfuse.calibrate.sequential import calibrate_sequential, round_chains
from qfuse.calibrate.shards import init_empty_weights
from qfuse.calibrate.stages import Stage, find_blocks, split_stages

__all__ = [
    "Stage",
    "calibrate_sequential",
    "find_blocks",
    "init_empty_weights",
    "round_chains",
    "split_stages",
]
