"""``qfuse::qlinear_launch``: one fused-GEMM launch as an opaque custom op, for traced calls.

``torch.compile`` traces ``qfuse::qlinear``'s body and launches its kernels from Inductor's own
code (``wrap_triton``). Two kinds of launch cannot be expressed that way (torch 2.11-2.13):
host-side tensor descriptors built inside the body (the TMA family: tracing passes
``tma_descriptor_metadata={}`` outside Dynamo), and launch options other than the schedule's
(the decode family's programmatic dependent launch: ``wrap_triton`` forwards ``num_warps`` and
the like, not ``launch_pdl``). Such a schedule is launched through this op instead: Inductor calls
it like any extern kernel (and CUDA graphs capture its launch), and it launches with the real
tensors. Its schema is ``qfuse::qlinear``'s (``call.OP_ARGS``, no defaults) plus the schedule.
"""

from __future__ import annotations

import dataclasses

import torch

from qfuse.kernels.gemm.call import OP_ARGS, GemmCall, OpArg, fake_output
from qfuse.kernels.gemm.launch import launch
from qfuse.kernels.schedules import GemmConfig

_FIELDS = [f.name for f in dataclasses.fields(GemmConfig)]


def _launch(*args, **kwargs) -> torch.Tensor:
    config = kwargs["config"] if "config" in kwargs else args[len(OP_ARGS.args)]
    x, call, x_scale, residual = GemmCall.from_op_args(*args, **kwargs)
    cfg = GemmConfig(**dict(zip(_FIELDS, config, strict=True)))
    out = torch.empty((x.shape[0], call.out_features), device=x.device, dtype=call.out_dtype)
    if x.shape[0]:
        launch(x, call, x_scale, residual, out, cfg)
    return out


_launch.__signature__ = OP_ARGS.signature(OpArg("config", "SymInt[]"), defaults=False)
qlinear_launch = torch.library.custom_op("qfuse::qlinear_launch", _launch, mutates_args=())
qlinear_launch.register_fake(fake_output)


def traced_qlinear(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None,
                   residual: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """``call`` on 2-D ``x`` with schedule ``cfg`` as one ``qfuse::qlinear_launch`` node."""
    config = [int(getattr(cfg, name)) for name in _FIELDS]
    return torch.ops.qfuse.qlinear_launch(*call.op_args(x, x_scale, residual), config)
