"""``qfuse::qlinear``: the fused quantized Linear as a torch custom op.

Registered with ``torch.library.triton_op``: ``torch.export`` and ``torch.jit.trace`` see one
node, while ``torch.compile`` traces the body, so Inductor launches the Triton kernels from its own
generated code (``wrap_triton``), fuses the ops around them and CUDA-graphs them under
``mode="reduce-overhead"``. CPU tensors run the PyTorch reference inside the same body.
"""

from __future__ import annotations

import os

import torch

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.common import out_features
from qfuse.ops import reference
from qfuse.ops.backend import Backend, resolve_backend

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

FP8 = torch.float8_e4m3fn
QUANTIZED_DTYPES = (torch.int8, FP8)


def _check(x, weight, x_inv_scale, x_zero_point, x_scale, out_inv_scale, out_dtype) -> None:
    K = x.shape[-1]
    if K != weight.shape[1]:
        raise ShapeError(
            f"qfuse::qlinear: input has {K} features but the layer was built for "
            f"{weight.shape[1]}; feed it the same feature size as the float model."
        )
    if weight.dtype not in QUANTIZED_DTYPES:
        raise UnsupportedError(
            f"qfuse::qlinear: weight dtype {weight.dtype}; build the layer with QLinear.from_float "
            "(int8 or float8_e4m3fn weights)."
        )
    if x.dtype in QUANTIZED_DTYPES and x.dtype != weight.dtype:
        raise UnsupportedError(
            f"qfuse::qlinear: {x.dtype} input to a {weight.dtype} layer; a quantized input must "
            "have the weight's dtype (convert the whole chain with one QConfig)."
        )
    dynamic = x.dtype not in QUANTIZED_DTYPES and x_inv_scale is None
    if (dynamic or weight.dtype == FP8) and x_zero_point is not None:
        raise UnsupportedError(
            "qfuse::qlinear: fp8 and dynamic activation quantization are symmetric; pass no "
            "x_zero_point (use QConfig.fp8_* / int8_dynamic, which are symmetric)."
        )
    if x_scale is not None and x.dtype not in QUANTIZED_DTYPES:
        raise UnsupportedError(
            "qfuse::qlinear: x_scale (per-token scales) belongs to an already quantized input."
        )
    if out_dtype in QUANTIZED_DTYPES and out_inv_scale is None:
        raise UnsupportedError(
            f"qfuse::qlinear: {out_dtype} output needs out_inv_scale (a static output scale); "
            "per-token output quantization is done by the next layer (dynamic config)."
        )


def _quantize_static(x, qdtype, inv_scale, zero_point):
    if qdtype == FP8:
        return reference.quantize_fp8(x.float(), inv_scale)
    zp = zero_point.float() if zero_point is not None else 0.0
    return reference.quantize_int8(x.float(), inv_scale, zp)


def _impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    x_scale: torch.Tensor | None = None,
    fast_act: bool = False,
) -> torch.Tensor:
    """Fused ``[quantize] -> int8/fp8 GEMM -> scale -> bias -> act -> [+ residual] -> [requant]``,
    the body of the ``qfuse::qlinear`` op.

    ``x`` is [..., K]: float with ``x_inv_scale`` (static per-tensor, ``x_zero_point`` optional
    for int8), float without it (dynamic per-token, symmetric), or already int8/fp8 (optionally
    with its per-token scales ``x_scale`` [...]). ``weight`` is int8 or fp8 [N, K]; ``scale`` [N]
    is ``s_x * s_w`` (static) or ``s_w`` (dynamic). Output [..., N] of ``out_dtype``; int8/fp8
    outputs are requantized with ``out_inv_scale`` (and ``out_zero_point`` for int8).
    ``weight_sum`` (int32 [N], ``sum_k W[n, k]``) applies ``- x_zero_point * weight_sum`` to the
    accumulator; pass None when that correction is already folded into ``bias``.
    ``fast_act`` runs GELU/SiLU with hardware erf/exp on the GPU (the CPU reference is exact).

    On CUDA the Triton kernels are launched through ``torch.library.wrap_triton``: traced by
    ``torch.compile``, Inductor launches them from its own generated code and CUDA-graphs them.
    """
    _check(x, weight, x_inv_scale, x_zero_point, x_scale, out_inv_scale, out_dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    N = out_features(weight.shape[0], activation)
    res2 = residual.reshape(-1, N) if residual is not None else None
    xs2 = x_scale.reshape(-1) if x_scale is not None else None
    args = (x2, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, res2)
    args += (out_inv_scale, out_zero_point, activation, out_dtype)
    if resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.gemm.dispatch import qlinear as kernel

        wrap = torch.library.wrap_triton if x.device.type == "cuda" and not INTERPRETED else None
        pre = None
        if wrap is not None and x_inv_scale is not None and x.dtype not in QUANTIZED_DTYPES:
            # Traced: a separate static quantize pass as torch ops (the reference's, bit-equal
            # to the kernel's), which Inductor fuses into the op producing x — in BERT, the
            # copy that lays SDPA's output out for the attention projection: one kernel less.
            pre = lambda t: _quantize_static(t, weight.dtype, x_inv_scale, x_zero_point)  # noqa: E731
        out = kernel(*args, x_scale=xs2, fast_act=fast_act, wrap=wrap, prequantize_fn=pre)
    else:
        out = reference.qlinear(*args, x_scale=xs2)
    return out.reshape(*lead, N)


qlinear = torch.library.triton_op("qfuse::qlinear", _impl, mutates_args=())


@qlinear.register_fake
def _(x, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, residual, out_inv_scale,
      out_zero_point, activation, out_dtype, x_scale=None, fast_act=False):
    return x.new_empty((*x.shape[:-1], out_features(weight.shape[0], activation)),
                       dtype=out_dtype)


def _eager(x: torch.Tensor) -> bool:
    """True when no tracer, compiler or tensor subclass needs to see the op."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def qlinear_call(x, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
                 out_inv_scale, out_zero_point, activation, out_dtype, x_scale=None,
                 fast_act=False, cache=None):
    """What modules call: the ``qfuse::qlinear`` op where it is traced, compiled, exported or
    differentiated; in plain eager inference the op's body directly, and on CUDA with a
    ``cache`` (the layer's own dict) cached compiled kernels
    (``kernels.qgemm_eager.qlinear_eager``).

    The op's dispatcher and autograd layers cost ~30 us of host time per call (measured on a
    CPU host: 44 us through the op against 12 us for the body alone), and Triton's own launch
    25-36 us on the H200 machine, as much as the whole kernel at decode sizes; skipping them
    changes no numbers (the cached launch is checked against Triton's on its first use).
    """
    if not _eager(x):
        return torch.ops.qfuse.qlinear(x, weight, scale, bias, x_inv_scale, x_zero_point,
                                       weight_sum, residual, out_inv_scale, out_zero_point,
                                       activation, out_dtype, x_scale, fast_act)
    if (cache is not None and x.is_cuda and x_scale is None and not INTERPRETED
            and resolve_backend(x.device) is Backend.TRITON):
        from qfuse.kernels.gemm.eager import qlinear_eager

        K = x.shape[-1]
        if x.dim() == 2 and K == weight.shape[1]:  # the hot path: no reshapes, checked plans
            return qlinear_eager(cache, x, weight, scale, bias, x_inv_scale, x_zero_point,
                                 weight_sum, residual, out_inv_scale, out_zero_point,
                                 activation, out_dtype, fast_act, _check)
        if x.dim() > 2 and K == weight.shape[1]:
            lead = x.shape[:-1]
            N = out_features(weight.shape[0], activation)
            res2 = residual.reshape(-1, N) if residual is not None else None
            out = qlinear_eager(cache, x.reshape(-1, K), weight, scale, bias, x_inv_scale,
                                x_zero_point, weight_sum, res2, out_inv_scale, out_zero_point,
                                activation, out_dtype, fast_act, _check)
            return out.view(*lead, N)
    return _impl(x, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
                 out_inv_scale, out_zero_point, activation, out_dtype, x_scale, fast_act)
