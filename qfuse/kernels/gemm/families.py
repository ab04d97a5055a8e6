"""The fused GEMM's kernel families, registered once: which Triton function a schedule runs, how
the launcher's arguments become that function's, and which launch routes it can take.

Every family computes the same numbers from the same call (``qgemm.gemm_args`` describes it once,
by name, in the MMA kernels' order); a schedule (``schedules.GemmConfig``) names its family by
its flags, and ``tuning`` times candidates of every family against each other per shape, op and
epilogue class. Adding a family: its kernel file, its candidates in ``schedules``, one row here.

- ``mma``: tensor-core tiles with pointer loads, split-K for small grids (``mma_gemm``).
- ``persistent``: the same, one program per SM walking the tiles (``mma_gemm``).
- ``decode``: weight streaming without tensor cores for M <= 8 (``decode_gemm``); on sm_90 a
  programmatic dependent launch, which ``wrap_triton`` cannot express, so traced calls take the
  opaque op there.
- ``tma``: tiles loaded through TMA descriptors, one-tile or persistent grids, optionally
  warp-specialized (``tma_gemm``); needs an already quantized x in memory; a programmatic
  dependent launch on sm_90.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from qfuse.kernels.gemm.decode import _qlinear_decode_kernel, decode_args
from qfuse.kernels.gemm.mma import _qlinear_kernel, _qlinear_persistent_kernel
from qfuse.kernels.gemm.tma import _qlinear_tma_kernel, tma_args
from qfuse.kernels.grid import pdl, pdl_options
from qfuse.kernels.schedules import GemmConfig


@dataclasses.dataclass(frozen=True)
class GemmFamily:
    """``bind(args, x, weight, cfg)``: the family's arguments by name from ``gemm_args``' (None:
    they are the MMA kernels' as they are). ``cached_eager``: the eager hot path may launch it
    through ``launcher.CachedLaunch`` (its leading arguments are plain pointers and M).
    ``wrap_traced``: traced calls launch it through ``wrap_triton``; otherwise through an opaque
    op (``opaque_launch``) that builds what tracing cannot capture at run time. ``options(args)``:
    launch options beyond the schedule's (``wrap_triton`` passes none, so a launch that has
    some is traced through the opaque op too); ``needs_options(device)`` says beforehand
    whether launches on ``device`` will."""

    name: str
    kernel: object
    bind: Callable | None = None
    cached_eager: bool = True
    wrap_traced: bool = True
    options: Callable[[dict], dict] | None = None
    needs_options: Callable[[torch.device], bool] | None = None

    def wraps(self, device: torch.device) -> bool:
        """Whether a traced launch on ``device`` may go through ``wrap_triton``."""
        return self.wrap_traced and not (self.needs_options is not None
                                         and self.needs_options(device))


FAMILIES = {
    "mma": GemmFamily("mma", _qlinear_kernel),
    "persistent": GemmFamily("persistent", _qlinear_persistent_kernel),
    "decode": GemmFamily("decode", _qlinear_decode_kernel, bind=decode_args,
                         options=pdl_options, needs_options=pdl),
    "tma": GemmFamily("tma", _qlinear_tma_kernel, bind=tma_args, cached_eager=False,
                      wrap_traced=False, options=pdl_options),
}


def family_name(cfg: GemmConfig) -> str:
    if cfg.tma:
        return "tma"
    if cfg.decode:
        return "decode"
    return "persistent" if cfg.persistent else "mma"


def family(cfg: GemmConfig) -> GemmFamily:
    return FAMILIES[family_name(cfg)]
