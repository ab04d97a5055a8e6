"""``qfuse::qlinear_launch``: one fused-GEMM launch as an opaque custom op, for traced calls.

``torch.compile`` traces ``qfuse::qlinear``'s body and launches its kernels from Inductor's own
code (``wrap_triton``). Two kinds of launch cannot be expressed that way (torch 2.11-2.13):
host-side tensor descriptors built inside the body (the TMA family: tracing passes
``tma_descriptor_metadata={}`` outside Dynamo), and launch options other than the schedule's
(the decode family's programmatic dependent launch: ``wrap_triton`` forwards ``num_warps`` and
the like, not ``launch_pdl``). Such a schedule is launched through this op instead: Inductor calls
it like any extern kernel (and CUDA graphs capture its launch), and it launches with the real
tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from qfuse.kernels.common import out_features
from qfuse.kernels.gemm.launch import launch
from qfuse.kernels.schedules import GemmConfig

_FIELDS = [f.name for f in dataclasses.fields(GemmConfig)]


@torch.library.custom_op("qfuse::qlinear_launch", mutates_args=())
def qlinear_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    x_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    config: list[int],
    fast_act: bool,
) -> torch.Tensor:
    cfg = GemmConfig(**dict(zip(_FIELDS, config, strict=True)))
    out = torch.empty((x.shape[0], out_features(weight.shape[0], activation)), device=x.device,
                      dtype=out_dtype)
    if x.shape[0]:
        launch(x, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
               out_inv_scale, out_zero_point, activation, out, cfg, fast_act)
    return out


@qlinear_launch.register_fake
def _(x, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
      out_inv_scale, out_zero_point, activation, out_dtype, config, fast_act):
    return x.new_empty((x.shape[0], out_features(weight.shape[0], activation)), dtype=out_dtype)


def traced_qlinear(x, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum,
                   residual, out_inv_scale, out_zero_point, act, out_dtype, cfg: GemmConfig,
                   fast_act: bool) -> torch.Tensor:
    config = [int(getattr(cfg, name)) for name in _FIELDS]
    return torch.ops.qfuse.qlinear_launch(x, weight, scale, x_scale, bias, x_inv_scale,
                                          x_zero_point, weight_sum, residual, out_inv_scale,
                                          out_zero_point, act, out_dtype, config, fast_act)
