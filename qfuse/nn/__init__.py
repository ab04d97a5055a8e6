"""Runtime modules of converted models: buffers plus a one-call forward into ``qfuse.ops``."""

from qfuse.nn.base import QuantizedModule
from qfuse.nn.qconv2d import QConv2d
from qfuse.nn.qlinear import QLinear

__all__ = ["QConv2d", "QLinear", "QuantizedModule"]
