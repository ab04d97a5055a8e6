"""``qfuse::gated``: ``act(y[..., 0::2]) * y[..., 1::2]``, the float form of a gated MLP whose
gate and up projections were merged into one Linear over interleaved rows (``fusion.gated``).

It is what a prepared (calibrating) graph computes between the merged Linear and the down
projection, with torch's own SiLU / GELU in the model's dtype, so calibration sees the float
model's values; convert fuses it into the GEMM's epilogue (``kernels.common.gated``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import GATED_ACTIVATIONS

_GATE_FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _float_gated(y: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
    return _GATE_FUNCTIONS[GATED_ACTIVATIONS[act]](gate) * up


@torch.library.custom_op("qfuse::gated", mutates_args=())
def gated(y: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of interleaved ``[g0, u0, g1, u1, ...]`` last-dimension values.

    Example:
        >>> import torch
        >>> g, u = torch.randn(3, 4), torch.randn(3, 4)
        >>> y = torch.stack([g, u], dim=-1).flatten(-2)   # interleaved
        >>> torch.equal(torch.ops.qfuse.gated(y, "swiglu"), torch.nn.functional.silu(g) * u)
        True
    """
    if act not in GATED_ACTIVATIONS:
        raise UnsupportedError(f"qfuse::gated: activation {act!r}; use one of "
                               f"{sorted(GATED_ACTIVATIONS)}.")
    return _float_gated(y, act)


@gated.register_fake
def _(y, act):
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.act = inputs[1]


def _backward(ctx, grad):
    # QAT trains through the merged gate/up layer: the gradient of the same float formula.
    (y,) = ctx.saved_tensors
    with torch.enable_grad():
        y = y.detach().requires_grad_(True)
        (dy,) = torch.autograd.grad(_float_gated(y, ctx.act), y, grad)
    return dy, None


gated.register_autograd(_backward, setup_context=_setup_context)
