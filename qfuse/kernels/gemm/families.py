"""The fused GEMM's kernel families, registered once: which schedules of the one kernel
(``kernel._qlinear_kernel``) a family runs, how the launcher's arguments become its flags, and
which launch routes it can take.

Every family computes the same numbers from the same call (``launch.gemm_args`` names its
arguments once); a schedule (``schedules.GemmConfig``) names its family by its flags, and
``tuning`` times candidates of every family against each other per shape, op and epilogue
class. Adding a family: its main loop in a file of its own, a flag in ``kernel``, its candidates
in ``schedules``, one row here.

- ``mma``: tensor-core tiles with pointer loads, split-K for small grids (``mma``).
- ``persistent``: the same, one program per SM walking the tiles (``mma``).
- ``decode``: weight streaming without tensor cores for M <= 8 (``decode``); on sm_90 a
  programmatic dependent launch, which ``wrap_triton`` cannot express, so traced calls take the
  opaque op there.
- ``tma``: tiles loaded through TMA descriptors, one-tile or persistent grids (``tma``); needs
  an already quantized x in memory; a programmatic dependent launch on sm_90.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from qfuse.kernels.gemm.decode import decode_args
from qfuse.kernels.gemm.kernel import _qlinear_kernel
from qfuse.kernels.gemm.mma import mma_args
from qfuse.kernels.gemm.tma import tma_args
from qfuse.kernels.grid import pdl, pdl_options
from qfuse.kernels.schedules import GemmConfig


@dataclasses.dataclass(frozen=True)
class GemmFamily:
    """``bind(args, x, weight, cfg)``: the kernel's arguments by name from ``gemm_args``', with
    the family's schedule flags. ``cached_eager``: the eager hot path may launch it
    through ``launcher.CachedLaunch`` (its leading arguments are plain pointers and M).
    ``wrap_traced``: traced calls launch it through ``wrap_triton``; otherwise through an opaque
    op (``opaque``) that builds what tracing cannot capture at run time. ``options(args)``:
    launch options beyond the schedule's (``wrap_triton`` passes none, so a launch that has
    some is traced through the opaque op too); ``needs_options(device)`` says beforehand
    whether launches on ``device`` will."""

    name: str
    kernel: object
    bind: Callable
    cached_eager: bool = True
    wrap_traced: bool = True
    options: Callable[[dict], dict] | None = None
    needs_options: Callable[[torch.device], bool] | None = None

    def wraps(self, device: torch.device) -> bool:
        """Whether a traced launch on ``device`` may go through ``wrap_triton``."""
        return self.wrap_traced and not (self.needs_options is not None
                                         and self.needs_options(device))


FAMILIES = {
    "mma": GemmFamily("mma", _qlinear_kernel, mma_args),
    "persistent": GemmFamily("persistent", _qlinear_kernel, mma_args),
    "decode": GemmFamily("decode", _qlinear_kernel, decode_args, options=pdl_options,
                         needs_options=pdl),
    "tma": GemmFamily("tma", _qlinear_kernel, tma_args, cached_eager=False, wrap_traced=False,
                      options=pdl_options),
}


def family_name(cfg: GemmConfig) -> str:
    if cfg.tma:
        return "tma"
    if cfg.decode:
        return "decode"
    return "persistent" if cfg.persistent else "mma"


def family(cfg: GemmConfig) -> GemmFamily:
    return FAMILIES[family_name(cfg)]
