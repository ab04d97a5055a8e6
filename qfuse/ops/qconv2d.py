"""``qfuse::qconv2d``: the fused quantized Conv2d as a torch ``triton_op``.

On CUDA tensors the body launches the Triton implicit-GEMM kernel (``qfuse.kernels.conv.implicit``)
through ``torch.library.wrap_triton``, so ``torch.compile`` sees the kernel itself and can put it
in its graph; on CPU tensors (or with ``QFUSE_BACKEND=reference``) the body is the PyTorch
reference. ``register_fake`` gives export and tracing the output's shape, dtype and
channels-last layout without running anything.
"""

from __future__ import annotations

import torch

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.conv.call import OP_ARGS, ConvCall, fake_output
from qfuse.kernels.layout import as_nhwc
from qfuse.ops import reference
from qfuse.ops.backend import Backend, eager, resolve_backend
from qfuse.ops.checks import QUANTIZED_DTYPES, check_dtypes
from qfuse.primitives import FP8_E4M3_MAX, SCALE_EPS, divide

FP8 = torch.float8_e4m3fn


def _check(x: torch.Tensor, call: ConvCall) -> None:
    weight, groups = call.weight, call.groups
    if x.dim() != 4 or x.shape[1] != weight.shape[1] * groups:
        raise ShapeError(
            f"qfuse::qconv2d: input of shape {tuple(x.shape)} for a layer built for "
            f"{weight.shape[1] * groups} input channels (N, C, H, W); feed it what the float "
            "model took."
        )
    check_dtypes("qconv2d", "QConv2d", x, weight)
    if x.dtype not in QUANTIZED_DTYPES and call.x_inv_scale is None:
        raise UnsupportedError(
            "qfuse::qconv2d: a float input needs x_inv_scale (a per-tensor activation scale: "
            "static, or computed on the fly by QConv2d with dynamic_input_qparams)."
        )
    if call.x_inv_scale is not None and call.x_inv_scale.numel() != 1:
        raise UnsupportedError(
            "qfuse::qconv2d: per-input-channel activation scales (SmoothQuant's prologue) are "
            "not supported for convolutions; use a per-tensor scale."
        )
    if weight.dtype == FP8 and call.x_zero_point is not None:
        raise UnsupportedError("qfuse::qconv2d: fp8 is symmetric; pass no x_zero_point.")
    if call.out_dtype in QUANTIZED_DTYPES and call.out_inv_scale is None:
        raise UnsupportedError(
            f"qfuse::qconv2d: {call.out_dtype} output needs out_inv_scale (a static output "
            "scale)."
        )


def _check_residual(call: ConvCall, residual: torch.Tensor | None) -> None:
    if residual is None or residual.dtype not in QUANTIZED_DTYPES:
        return
    if call.residual_scale is None or call.residual_scale.numel() != 1:
        raise UnsupportedError(
            f"qfuse::qconv2d: a {residual.dtype} residual needs residual_scale (one per-tensor "
            "scale of the layer that wrote it); pass a float residual otherwise."
        )
    if residual.dtype == FP8 and call.residual_zero_point is not None:
        raise UnsupportedError("qfuse::qconv2d: an fp8 residual is symmetric; no zero point.")


def qconv2d_body(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Fused ``[quantize] -> int8/fp8 conv2d -> scale -> bias -> act -> [+ residual] ->
    post-act -> [requant]``, the body of the ``qfuse::qconv2d`` op; output channels-last. An
    int8/fp8 residual comes with ``call.residual_scale`` (and ``residual_zero_point``):
    ``(r - zp) * scale`` is added."""
    _check(x, call)
    _check_residual(call, residual)
    if resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.conv.implicit import qconv2d as kernel

        # Traced (compile, export): wrap_triton puts the kernel itself into the graph (a 1x1
        # conv on the TMA GEMM: the opaque qfuse::tma_conv1x1, see kernels.conv.tma). Plain
        # eager, and the interpreter: a direct launch (the wrapper's dispatch costs more host
        # time than a small conv kernel runs).
        traced = x.device.type != "cpu" and not eager(x)
        return kernel(x, call, residual, launcher=torch.library.wrap_triton if traced else None)
    return as_nhwc(reference.qconv2d(x, call, residual))


def _op(*args, **kwargs) -> torch.Tensor:
    return qconv2d_body(*ConvCall.from_op_args(*args, **kwargs))


# The schema torch.library infers from this signature is the op's, argument by argument.
_op.__signature__ = OP_ARGS.signature()
qconv2d = torch.library.triton_op("qfuse::qconv2d", _op, mutates_args=())
qconv2d.register_fake(fake_output)


def dynamic_input_qparams(
    x: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor activation quantization of a conv input, on ``x``'s device with no host
    synchronisation: ``(scale, inv_scale)``, 0-d float32, ``scale = max(amax / qmax, eps)`` with
    qmax 127.5 for int8 (``primitives.choose_qparams``' symmetric convention) and 448 for fp8.

    ``amax`` is over the finite values: one NaN or Inf sample must not change the scale the
    other samples of its batch are quantized with (``fusion.nonfinite`` marks it instead).
    The scale then runs the static conv path as a device tensor (``QConv2d``).

    Example:
        >>> x = torch.tensor([[-2.55, 1.0, float("nan")]])
        >>> s, inv = dynamic_input_qparams(x, torch.int8)
        >>> round(s.item(), 6)
        0.02
    """
    x = x.to(torch.float32)
    qmax = FP8_E4M3_MAX if qdtype == FP8 else 127.5
    if x.numel() == 0:  # an empty batch: any scale quantizes nothing
        amax = x.new_zeros(())
    else:
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax()
    scale = torch.clamp(divide(amax, qmax), min=SCALE_EPS)
    return scale, torch.reciprocal(scale)


def qconv2d_call(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """What ``QConv2d`` calls: the ``qfuse::qconv2d`` op where it is traced, compiled, exported
    or differentiated, its Python body directly in plain eager inference (the dispatcher's
    per-call host cost is as large as a small conv kernel)."""
    if eager(x):
        return qconv2d_body(x, call, residual)
    return torch.ops.qfuse.qconv2d(*call.op_args(x, residual))
