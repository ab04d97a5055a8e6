"""Argument checks the fused ops share, with errors that say what to do."""

from __future__ import annotations

import torch

from qfuse.errors import UnsupportedError

FP8 = torch.float8_e4m3fn
QUANTIZED_DTYPES = (torch.int8, FP8)


def check_dtypes(op: str, module: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``qfuse::{op}``'s weight is int8 or fp8 (built by ``{module}.from_float``), and a quantized
    input has the weight's dtype."""
    if weight.dtype not in QUANTIZED_DTYPES:
        raise UnsupportedError(
            f"qfuse::{op}: weight dtype {weight.dtype}; build the layer with {module}.from_float "
            "(int8 or float8_e4m3fn weights)."
        )
    if x.dtype in QUANTIZED_DTYPES and x.dtype != weight.dtype:
        raise UnsupportedError(
            f"qfuse::{op}: {x.dtype} input to a {weight.dtype} layer; a quantized input must "
            "have the weight's dtype (convert the whole chain with one QConfig)."
        )
