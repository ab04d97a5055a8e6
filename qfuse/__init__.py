"""qfuse: quantization-aware fusion for PyTorch.

    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    for batch in calibration_batches:
        prepared(batch)
    qmodel = qfuse.convert(prepared)
    print(qfuse.summary(qmodel))
"""

from qfuse import integrations as _integrations
from qfuse._version import __version__
from qfuse.algorithms.gptq import GPTQ
from qfuse.algorithms.smoothquant import SmoothQuant
from qfuse.analysis.fallback import FallbackResult, auto_fallback
from qfuse.analysis.routing import CostModel, RoutePlan, route
from qfuse.analysis.sensitivity import SensitivityReport, sensitivity
from qfuse.analysis.summary import Summary, summary
from qfuse.calibrate import calibrate_sequential
from qfuse.config import PerChannel, PerTensor, PerToken, QConfig
from qfuse.errors import (
    BackendError,
    CalibrationError,
    CaptureError,
    DeviceError,
    FormatError,
    GraphMismatchError,
    ModeError,
    QFuseError,
    ShapeError,
    UnsupportedError,
    WeightsError,
)
from qfuse.export import export_onnx, export_program, export_torchscript, load, save
from qfuse.export.compressed_tensors import export_compressed_tensors, load_compressed_tensors
from qfuse.flows.convert import convert
from qfuse.flows.prepare import prepare
from qfuse.flows.qat import QATConfig, prepare_qat, sync_observers
from qfuse.ops.backend import Backend, resolve_backend, use_backend
from qfuse.pipeline import PipelineOptions
from qfuse.tools.search import SearchResult, SearchSpace, search

_integrations.install()  # transformers: quant_method "qfuse" (save/from_pretrained)

__all__ = [
    "__version__",
    "Backend",
    "BackendError",
    "CalibrationError",
    "CaptureError",
    "CostModel",
    "DeviceError",
    "FallbackResult",
    "FormatError",
    "GraphMismatchError",
    "ModeError",
    "PerChannel",
    "PerTensor",
    "PerToken",
    "PipelineOptions",
    "QATConfig",
    "QConfig",
    "QFuseError",
    "SearchResult",
    "SearchSpace",
    "SensitivityReport",
    "ShapeError",
    "SmoothQuant",
    "GPTQ",
    "Summary",
    "UnsupportedError",
    "WeightsError",
    "auto_fallback",
    "calibrate_sequential",
    "convert",
    "prepare",
    "prepare_qat",
    "resolve_backend",
    "route",
    "search",
    "RoutePlan",
    "sensitivity",
    "summary",
    "sync_observers",
    "use_backend",
    "save",
    "load",
    "export_torchscript",
    "export_program",
    "export_compressed_tensors",
    "load_compressed_tensors",
    "export_onnx",
]
