"""Calibration of models larger than the GPU: one block at a time (``calibrate_sequential``),
optionally over ``torch.distributed`` ranks."""

from qfuse.calibrate.sequential import calibrate_sequential, round_chains
from qfuse.calibrate.stages import Stage, find_blocks, split_stages

__all__ = ["Stage", "calibrate_sequential", "find_blocks", "round_chains", "split_stages"]
