"""Shipping converted models: ``save``/``load`` (safetensors), TorchScript, torch.export, ONNX QDQ.

See ``docs/export.md`` for the file layout, the metadata schema and which format to pick.
"""

from qfuse.export.compressed_tensors import export_compressed_tensors, load_compressed_tensors
from qfuse.export.onnx import export_onnx
from qfuse.export.program import export_program
from qfuse.export.safetensors import load, save
from qfuse.export.torchscript import export_torchscript

__all__ = [
    "export_compressed_tensors",
    "export_onnx",
    "export_program",
    "export_torchscript",
    "load",
    "load_compressed_tensors",
    "save",
]
