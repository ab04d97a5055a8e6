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
from qfuse.kernels.layout import as_nhwc, empty_nhwc
from qfuse.ops import reference
from qfuse.ops.backend import Backend, resolve_backend
from qfuse.primitives import SCALE_EPS, divide

FP8 = torch.float8_e4m3fn
QUANTIZED_DTYPES = (torch.int8, FP8)


def _check(x, weight, x_inv_scale, x_zero_point, out_inv_scale, out_dtype, groups) -> None:
    if x.dim() != 4 or x.shape[1] != weight.shape[1] * groups:
        raise ShapeError(
            f"qfuse::qconv2d: input of shape {tuple(x.shape)} for a layer built for "
            f"{weight.shape[1] * groups} input channels (N, C, H, W); feed it what the float "
            "model took."
        )
    if weight.dtype not in QUANTIZED_DTYPES:
        raise UnsupportedError(
            f"qfuse::qconv2d: weight dtype {weight.dtype}; build the layer with "
            "QConv2d.from_float (int8 or float8_e4m3fn weights)."
        )
    if x.dtype in QUANTIZED_DTYPES and x.dtype != weight.dtype:
        raise UnsupportedError(
            f"qfuse::qconv2d: {x.dtype} input to a {weight.dtype} layer; a quantized input must "
            "have the weight's dtype (convert the whole chain with one QConfig)."
        )
    if x.dtype not in QUANTIZED_DTYPES and x_inv_scale is None:
        raise UnsupportedError(
            "qfuse::qconv2d: a float input needs x_inv_scale (a per-tensor activation scale: "
            "static, or computed on the fly by QConv2d with dynamic_input_qparams)."
        )
    if x_inv_scale is not None and x_inv_scale.numel() != 1:
        raise UnsupportedError(
            "qfuse::qconv2d: per-input-channel activation scales (SmoothQuant's prologue) are "
            "not supported for convolutions; use a per-tensor scale."
        )
    if weight.dtype == FP8 and x_zero_point is not None:
        raise UnsupportedError("qfuse::qconv2d: fp8 is symmetric; pass no x_zero_point.")
    if out_dtype in QUANTIZED_DTYPES and out_inv_scale is None:
        raise UnsupportedError(
            f"qfuse::qconv2d: {out_dtype} output needs out_inv_scale (a static output scale)."
        )


def _check_residual(x, weight, residual, residual_scale, residual_zero_point) -> None:
    if residual is None or residual.dtype not in QUANTIZED_DTYPES:
        return
    if residual_scale is None or residual_scale.numel() != 1:
        raise UnsupportedError(
            f"qfuse::qconv2d: a {residual.dtype} residual needs residual_scale (one per-tensor "
            "scale of the layer that wrote it); pass a float residual otherwise."
        )
    if residual.dtype == FP8 and residual_zero_point is not None:
        raise UnsupportedError("qfuse::qconv2d: an fp8 residual is symmetric; no zero point.")


def _impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    post_activation: str = "none",
    residual_scale: torch.Tensor | None = None,
    residual_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused ``[quantize] -> int8/fp8 conv2d -> scale -> bias -> act -> [+ residual] ->
    post-act -> [requant]``; output channels-last. An int8/fp8 residual comes with
    ``residual_scale`` (and ``residual_zero_point``): ``(r - zp) * scale`` is added."""
    _check(x, weight, x_inv_scale, x_zero_point, out_inv_scale, out_dtype, groups)
    _check_residual(x, weight, residual, residual_scale, residual_zero_point)
    args = (x, weight, scale, bias, x_inv_scale, x_zero_point, residual, out_inv_scale,
            out_zero_point, activation, out_dtype, stride, padding, dilation, groups,
            post_activation)
    res_q = dict(residual_scale=residual_scale, residual_zero_point=residual_zero_point)
    if x.device.type != "cpu" and resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.conv.implicit import qconv2d as kernel

        # Traced (compile, export): wrap_triton puts the kernel itself into the graph (a 1x1
        # conv on the TMA GEMM: the opaque qfuse::tma_conv1x1, see kernels.conv_tma). Plain
        # eager: a direct launch; the wrapper's dispatch cost ~0.3 ms of host time per call.
        return kernel(*args, launcher=None if _eager(x) else torch.library.wrap_triton, **res_q)
    if x.device.type == "cpu" and resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.conv.implicit import qconv2d as kernel  # interpreter (tests, debugging)

        return kernel(*args, **res_q)
    return as_nhwc(reference.qconv2d(*args, **res_q))


qconv2d = torch.library.triton_op("qfuse::qconv2d", _impl, mutates_args=())


@qconv2d.register_fake
def _(x, weight, scale, bias, x_inv_scale, x_zero_point, residual, out_inv_scale,
      out_zero_point, activation, out_dtype, stride, padding, dilation, groups,
      post_activation="none", residual_scale=None, residual_zero_point=None):
    n, _, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return empty_nhwc((n, weight.shape[0], oh, ow), out_dtype, x.device)


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
    qmax = 448.0 if qdtype == FP8 else 127.5
    if x.numel() == 0:  # an empty batch: any scale quantizes nothing
        amax = x.new_zeros(())
    else:
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax()
    scale = torch.clamp(divide(amax, qmax), min=SCALE_EPS)
    return scale, torch.reciprocal(scale)


def _eager(x: torch.Tensor) -> bool:
    """True when no tracer, compiler or tensor subclass needs to see the op."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def qconv2d_call(*args) -> torch.Tensor:
    """What ``QConv2d`` calls: the ``qfuse::qconv2d`` op where it is traced, compiled, exported
    or differentiated, its Python body directly in plain eager inference (the dispatcher's
    per-call host cost is as large as a small conv kernel)."""
    fn = _impl if _eager(args[0]) else torch.ops.qfuse.qconv2d
    return fn(*args)
