"""torch.library custom ops (``qfuse::*``): schema, fake tensors, and backend dispatch."""

from qfuse.ops.backend import Backend, resolve_backend, use_backend
from qfuse.ops.gated import gated
from qfuse.ops.layernorm import layer_norm_quant
from qfuse.ops.pool import max_pool2d
from qfuse.ops.qconv2d import qconv2d
from qfuse.ops.qlinear import qlinear

__all__ = [
    "Backend", "gated", "layer_norm_quant", "max_pool2d", "qconv2d", "qlinear", "resolve_backend",
    "use_backend",
]
