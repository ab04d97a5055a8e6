"""Quantization-aware training that converts to the same fused kernels as PTQ.

qat = qfuse.prepare_qat(model.train(), qfuse.QConfig.int8_static(), example_inputs=(x,))
... train qat like the float model ...
qmodel = qfuse.convert(qat.eval())
"""

from qfuse.flows.qat.config import QATConfig
from qfuse.flows.qat.distributed import sync_observers
from qfuse.flows.qat.prepare import prepare_qat

__all__ = ["QATConfig", "prepare_qat", "sync_observers"]
