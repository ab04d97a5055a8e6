"""``qfuse::qlinear``: the fused quantized Linear as a torch custom op.

Registered with ``torch.library.triton_op``: ``torch.export`` and ``torch.jit.trace`` see one
node, while ``torch.compile`` traces the body, so Inductor launches the Triton kernels from its own
generated code (``wrap_triton``), fuses the ops around them and CUDA-graphs them under
``mode="reduce-overhead"``. CPU tensors run the PyTorch reference inside the same body.

A layer's call is described once (``kernels.gemm.call.GemmCall``); the op takes it flat, as its
schema (``call.OP_ARGS``) lists it, and builds it back in its body.
"""

from __future__ import annotations

import torch

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.common import INTERPRETED
from qfuse.kernels.gemm.call import OP_ARGS, GemmCall, fake_output
from qfuse.ops import reference
from qfuse.ops.backend import Backend, eager, kernel_wrap, resolve_backend
from qfuse.ops.checks import QUANTIZED_DTYPES, check_dtypes

FP8 = torch.float8_e4m3fn


def _check(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None) -> None:
    weight = call.weight
    K = x.shape[-1]
    if K != weight.shape[1]:
        raise ShapeError(
            f"qfuse::qlinear: input has {K} features but the layer was built for "
            f"{weight.shape[1]}; feed it the same feature size as the float model."
        )
    check_dtypes("qlinear", "QLinear", x, weight)
    dynamic = x.dtype not in QUANTIZED_DTYPES and call.x_inv_scale is None
    if (dynamic or weight.dtype == FP8) and call.x_zero_point is not None:
        raise UnsupportedError(
            "qfuse::qlinear: fp8 and dynamic activation quantization are symmetric; pass no "
            "x_zero_point (use QConfig.fp8_* / int8_dynamic, which are symmetric)."
        )
    if x_scale is not None and x.dtype not in QUANTIZED_DTYPES:
        raise UnsupportedError(
            "qfuse::qlinear: x_scale (per-token scales) belongs to an already quantized input."
        )
    if call.out_dtype in QUANTIZED_DTYPES and call.out_inv_scale is None:
        raise UnsupportedError(
            f"qfuse::qlinear: {call.out_dtype} output needs out_inv_scale (a static output "
            "scale); per-token output quantization is done by the next layer (dynamic config)."
        )


def _quantize_static(x: torch.Tensor, call: GemmCall) -> torch.Tensor:
    if call.weight.dtype == FP8:
        return reference.quantize_fp8(x.float(), call.x_inv_scale)
    zp = call.x_zero_point.float() if call.x_zero_point is not None else 0.0
    return reference.quantize_int8(x.float(), call.x_inv_scale, zp)


def qlinear_body(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """Fused ``[quantize] -> int8/fp8 GEMM -> scale -> bias -> act -> [+ residual] -> [requant]``,
    the body of the ``qfuse::qlinear`` op.

    ``x`` is [..., K]: float with ``call.x_inv_scale`` (static per-tensor, ``x_zero_point``
    optional for int8), float without it (dynamic per-token, symmetric), or already int8/fp8
    (optionally with its per-token scales ``x_scale`` [...]). Output [..., N] of
    ``call.out_dtype``; ``residual`` [..., N] is added after the activation. See ``GemmCall``.

    On CUDA the Triton kernels are launched through ``torch.library.wrap_triton``: traced by
    ``torch.compile``, Inductor launches them from its own generated code and CUDA-graphs them.
    """
    _check(x, call, x_scale)
    lead, K = x.shape[:-1], x.shape[-1]
    N = call.out_features
    x2 = x.reshape(-1, K)
    res2 = residual.reshape(-1, N) if residual is not None else None
    xs2 = x_scale.reshape(-1) if x_scale is not None else None
    if resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.gemm.dispatch import qlinear as kernel

        wrap = kernel_wrap(x.device)
        pre = None
        if wrap is not None and call.x_inv_scale is not None and x.dtype not in QUANTIZED_DTYPES:
            # Traced: a separate static quantize pass as torch ops (the reference's, bit-equal
            # to the kernel's), which Inductor fuses into the op producing x — in BERT, the
            # copy that lays SDPA's output out for the attention projection: one kernel less.
            pre = lambda t: _quantize_static(t, call)  # noqa: E731
        out = kernel(x2, call, xs2, res2, wrap=wrap, prequantize_fn=pre)
    else:
        out = reference.qlinear(x2, call, xs2, res2)
    return out.reshape(*lead, N)


def _op(*args, **kwargs) -> torch.Tensor:
    return qlinear_body(*GemmCall.from_op_args(*args, **kwargs))


# The schema torch.library infers from this signature is the op's, argument by argument.
_op.__signature__ = OP_ARGS.signature()
qlinear = torch.library.triton_op("qfuse::qlinear", _op, mutates_args=())
qlinear.register_fake(fake_output)


def qlinear_call(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, cache: dict | None = None
                 ) -> torch.Tensor:
    """What modules call: the ``qfuse::qlinear`` op where it is traced, compiled, exported or
    differentiated; in plain eager inference ``qlinear_eager_call``.

    Example:
        >>> import torch
        >>> call = GemmCall(torch.randint(-127, 128, (4, 8), dtype=torch.int8), torch.ones(4))
        >>> qlinear_call(torch.randn(2, 3, 8), call).shape
        torch.Size([2, 3, 4])
    """
    if not eager(x):
        return torch.ops.qfuse.qlinear(*call.op_args(x, x_scale, residual))
    return qlinear_eager_call(x, call, x_scale, residual, cache)


def qlinear_eager_call(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None, cache: dict | None = None
                       ) -> torch.Tensor:
    """A plain eager call (``backend.eager``): the op's body directly, and on CUDA with a
    ``cache`` (the layer's own dict) cached compiled kernels (``kernels.gemm.eager``).

    The op's dispatcher and autograd layers cost several times the body's own host time per
    call, and Triton's own launch as much as the whole kernel at decode sizes; skipping them
    changes no numbers (the cached launch is checked against Triton's on its first use).
    """
    if (cache is not None and x.is_cuda and x_scale is None and not INTERPRETED
            and resolve_backend(x.device) is Backend.TRITON):
        from qfuse.kernels.gemm.eager import qlinear_eager

        K = x.shape[-1]
        if x.dim() == 2 and K == call.weight.shape[1]:  # the hot path: no reshapes, checked plans
            return qlinear_eager(cache, x, call, residual, _check)
        if x.dim() > 2 and K == call.weight.shape[1]:
            lead = x.shape[:-1]
            N = call.out_features
            res2 = residual.reshape(-1, N) if residual is not None else None
            return qlinear_eager(cache, x.reshape(-1, K), call, res2, _check).view(*lead, N)
    return qlinear_body(x, call, x_scale, residual)
