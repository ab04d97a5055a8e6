"""qfuse: quantization-aware fusion for PyTorch.

    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    for batch in calibration_batches:
        prepared(batch)
    qmodel = qfuse.convert(prepared)
    print(qfuse.summary(qmodel))

``import qfuse`` loads the configs and errors only; every other name loads its module on first
use (``qfuse.prepare``, ``from qfuse import convert``). The flows pull in torch.export, and the
``qfuse::*`` ops Triton and torch's Inductor (``torch.library.triton_op`` reads its kernels'
source with Inductor's helpers): about 2 s that a process only running a converted model from
``torch.export.load`` should not pay twice, and a ``qfuse --help`` not at all.
"""

import importlib
import importlib.util
import pkgutil
import sys

import torch

from qfuse import integrations as _integrations
from qfuse._version import __version__
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

# Public name -> the module that defines it, imported on first access (PEP 562).
_LAZY = {
    "AWQ": "qfuse.algorithms.awq",
    "GPTQ": "qfuse.algorithms.gptq",
    "SmoothQuant": "qfuse.algorithms.smoothquant",
    "FallbackResult": "qfuse.analysis.fallback",
    "auto_fallback": "qfuse.analysis.fallback",
    "CostModel": "qfuse.analysis.routing",
    "RoutePlan": "qfuse.analysis.routing",
    "route": "qfuse.analysis.routing",
    "SensitivityReport": "qfuse.analysis.sensitivity",
    "sensitivity": "qfuse.analysis.sensitivity",
    "Summary": "qfuse.analysis.summary",
    "summary": "qfuse.analysis.summary",
    "calibrate_sequential": "qfuse.calibrate",
    "export_onnx": "qfuse.export",
    "export_program": "qfuse.export",
    "export_torchscript": "qfuse.export",
    "load": "qfuse.export",
    "save": "qfuse.export",
    "export_compressed_tensors": "qfuse.export.compressed_tensors",
    "load_compressed_tensors": "qfuse.export.compressed_tensors",
    "convert": "qfuse.flows.convert",
    "prepare": "qfuse.flows.prepare",
    "QATConfig": "qfuse.flows.qat",
    "prepare_qat": "qfuse.flows.qat",
    "sync_observers": "qfuse.flows.qat",
    "Backend": "qfuse.ops.backend",
    "resolve_backend": "qfuse.ops.backend",
    "use_backend": "qfuse.ops.backend",
    "PipelineOptions": "qfuse.pipeline",
    "SearchResult": "qfuse.tools.search",
    "SearchSpace": "qfuse.tools.search",
    "search": "qfuse.tools.search",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"qfuse.{name}") is not None:
        value = importlib.import_module(f"qfuse.{name}")  # ``qfuse.export.onnx`` as before
    else:
        raise AttributeError(f"module 'qfuse' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def register_ops() -> None:
    """Register every ``qfuse::*`` op with torch (what running any qfuse flow does). Needed
    before ``torch.jit.load`` of an exported TorchScript file, whose C++ loader looks ops up
    past any Python hook; ``torch.export.load`` and a pickled model find them without it.

    Example:
        >>> import torch, qfuse
        >>> qfuse.register_ops()
        >>> torch.ops.qfuse.qlinear.default.name()
        'qfuse::qlinear'
    """
    import qfuse.kernels.conv.tma  # noqa: F401 -- qfuse::tma_conv1x1 (a CUDA program's)
    import qfuse.kernels.gemm.opaque  # noqa: F401 -- qfuse::qlinear_launch
    import qfuse.ops

    for module in pkgutil.iter_modules(qfuse.ops.__path__, "qfuse.ops."):
        importlib.import_module(module.name)  # every qfuse::* op of the layers


class _OpsOnFirstUse(torch._ops._OpNamespace):
    """``torch.ops.qfuse``, registering qfuse's ops the first time one is looked up: a program
    saved by ``qfuse.export_program`` loads with ``torch.export.load`` after ``import qfuse``
    alone, as before the ops were loaded lazily."""

    # The ops' ``__module__`` is derived from this: as torch's own namespaces', so a program
    # names them ``torch.ops.qfuse.*`` (from here it wrote "qfuse.qfuse.qlinear.default").
    __module__ = torch._ops._OpNamespace.__module__

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # torch asks whether an op exists while qfuse's own modules define theirs: loading
            # the rest then would import those modules half-initialised. Not there yet.
            if name.startswith("__") or _importing_qfuse():
                raise
        register_ops()
        return super().__getattr__(name)


def _importing_qfuse() -> bool:
    """Whether a ``qfuse.*`` module is being executed by the import system right now."""
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name.startswith("qfuse.")
    )


if "qfuse" not in torch.ops.__dict__:
    torch.ops.qfuse = _OpsOnFirstUse("qfuse")

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
    "AWQ",
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
    "register_ops",
]
