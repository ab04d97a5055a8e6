"""The fused quantized GEMM's launcher: int8 or fp8 e4m3, with the whole epilogue in registers.

    acc[M, N] = x_q @ W_q^T                       (int8: int32 accumulate; fp8: float32)
    y = (acc - zp_x * colsum(W)) * scale[n] [* x_scale[m]] + bias[n]
    out = requant?( (+ residual)( act(y) ) )      (int8 / fp8 with a static scale, or float)

x is float (quantized in the prologue with a static per-tensor scale: no extra pass over HBM),
or already quantized — handed over by the previous fused layer, or by ``quantize.quantize`` with
per-token scales ``x_scale[m]`` (dynamic). W is [N, K] int8 or fp8 with one float32 scale per
output channel, folded with a static activation scale into ``scale[n] = s_x * s_w[n]``.

One kernel (``kernel``) runs every schedule, its main loops one family a file (``families``:
MMA tiles with split-K and their persistent form, ``mma``; weight streaming for the smallest M,
``decode``; TMA descriptor loads, ``tma``). A call is described once per layer (``call.GemmCall``)
and launched by ``launch`` (``gemm_args``: every kernel argument by name) with the schedule
``tuning`` picked here: plainly, through ``wrap_triton`` when traced, or (a family that tracing
cannot capture) through its opaque op.
"""

from __future__ import annotations

import torch

from qfuse.kernels.common import INTERPRETED, LIGHT_ACTIVATIONS
from qfuse.kernels.gemm.call import GemmCall
from qfuse.kernels.gemm.families import family
from qfuse.kernels.gemm.launch import _is_quantized, launch
from qfuse.kernels.gemm.opaque import traced_qlinear
from qfuse.kernels.schedules import GemmConfig
from qfuse.kernels.tuning import pick_config


def schedule(x: torch.Tensor, call: GemmCall, run=None, config: GemmConfig | None = None,
             x_float: bool | None = None) -> GemmConfig:
    """``config``, or the schedule ``tuning.pick_config`` gives ``call`` on 2-D ``x`` (timing
    candidates through ``run(cfg)`` when given). ``x_float``: whether x is quantized in this
    call (the prologue or a pass of its own): a float x with a static scale."""
    if config is not None:
        return config
    M, K = x.shape
    if x_float is None:
        x_float = not _is_quantized(x) and call.x_inv_scale is not None
    fp8 = call.weight.dtype == torch.float8_e4m3fn
    kind = f"{'fp8' if fp8 else 'int8'}-{'xf' if x_float else 'xq'}"
    heavy = call.act not in LIGHT_ACTIVATIONS
    return pick_config(M, call.weight.shape[0], K, kind, x.device, INTERPRETED, run, heavy,
                       x.element_size(), epilogue=call.act if heavy else "")


def qlinear(
    x: torch.Tensor,
    call: GemmCall,
    x_scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    wrap=None,
    prequantize_fn=None,
) -> torch.Tensor:
    """The fused quantized linear ``call`` on 2-D ``x`` [M, K]; returns [M, N].

    - ``x`` float with ``call.x_inv_scale``: static quantization (in the prologue, or by a
      separate pass when the schedule says that is faster — same numbers either way).
    - ``x`` float without it: dynamic per-token quantization (symmetric).
    - ``x`` int8/fp8: already quantized; ``x_scale`` [M] holds its per-token scales if dynamic.
    ``residual`` [M, N] is added after the activation. ``config`` pins a schedule (tests,
    tuning); otherwise ``tuning.pick_config`` chooses one (no autotuning while traced: the tuned
    table, the cache, or the first candidate). ``wrap``: see ``launch``.
    ``prequantize_fn(x)``: where a schedule quantizes a static float x in a separate pass, do it
    with this instead of ``quantize``'s kernel (the traced op passes the reference's torch ops,
    which Inductor fuses into the kernel that produced x).

    Example (on CPU this runs under the Triton interpreter, TRITON_INTERPRET=1):
        >>> import torch
        >>> from qfuse.ops.reference import qlinear as ref
        >>> call = GemmCall(torch.randint(-127, 128, (16, 32), dtype=torch.int8),
        ...                 torch.full((16,), 1e-3), x_inv_scale=torch.tensor(40.0),
        ...                 out_inv_scale=torch.tensor(20.0), act="relu", out_dtype=torch.int8)
        >>> x = torch.randn(5, 32)
        >>> bool(torch.equal(qlinear(x, call), ref(x, call)))
        True
    """
    from qfuse.kernels.quantize import quantize

    M = x.shape[0]
    out = torch.empty((M, call.out_features), device=x.device, dtype=call.out_dtype)
    if isinstance(M, int) and M == 0:
        return out
    qdtype = call.weight.dtype
    x_float = not _is_quantized(x)
    if x_float and call.x_inv_scale is None:  # dynamic: a row's scale needs the whole row first
        x, x_scale = quantize(x, qdtype, None, None, INTERPRETED, wrap=wrap)
        x_float = False

    def run(cfg: GemmConfig) -> torch.Tensor:
        xq = x
        if x_float and cfg.prequantize and prequantize_fn is not None:
            xq = prequantize_fn(x)
        elif x_float and cfg.prequantize:
            xq, _ = quantize(x, qdtype, call.x_inv_scale, call.x_zero_point, INTERPRETED,
                             wrap=wrap)
        if wrap is not None and not family(cfg).wraps(x.device):
            # Traced: Inductor cannot yet capture host-side descriptors made inside a
            # triton_op's body, nor pass launch options such as programmatic dependent launch,
            # so such a launch is an opaque op of its own (CUDA-graphed like any other kernel;
            # its descriptors are built at run time).
            return traced_qlinear(xq, call, x_scale, residual, cfg)
        launch(xq, call, x_scale, residual, out, cfg, wrap)
        return out

    tunable = wrap is None  # never time candidates on fake tensors
    return run(schedule(x, call, run if tunable else None, config, x_float))
