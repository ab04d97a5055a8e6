"""The fused quantized GEMM's launcher: int8 or fp8 e4m3, with the whole epilogue in registers.

    acc[M, N] = x_q @ W_q^T                       (int8: int32 accumulate; fp8: float32)
    y = (acc - zp_x * colsum(W)) * scale[n] [* x_scale[m]] + bias[n]
    out = requant?( (+ residual)( act(y) ) )      (int8 / fp8 with a static scale, or float)

x is float (quantized in the prologue with a static per-tensor scale: no extra pass over HBM),
or already quantized — handed over by the previous fused layer, or by ``quantize.quantize`` with
per-token scales ``x_scale[m]`` (dynamic). W is [N, K] int8 or fp8 with one float32 scale per
output channel, folded with a static activation scale into ``scale[n] = s_x * s_w[n]``.

The kernels live one family a file (``families``: MMA tiles with split-K and their persistent
form, ``mma``; weight streaming for the smallest M, ``decode``; TMA descriptor loads, ``tma``).
``launch`` describes one call once (``gemm_args``: every argument by name) and binds it to the
family of the schedule ``tuning`` picked here; this module launches it plainly, through
``wrap_triton`` when traced, or (a family that tracing cannot capture) through its opaque op.
"""

from __future__ import annotations

import torch

from qfuse.kernels.common import LIGHT_ACTIVATIONS, out_features
from qfuse.kernels.gemm.families import family
from qfuse.kernels.gemm.launch import INTERPRETED, _is_quantized, launch
from qfuse.kernels.gemm.opaque import traced_qlinear
from qfuse.kernels.schedules import GemmConfig
from qfuse.kernels.tuning import pick_config


def _schedule(M, N, K, x, qdtype, x_float, act, device, run, config):
    kind = f"{'fp8' if qdtype == torch.float8_e4m3fn else 'int8'}-{'xf' if x_float else 'xq'}"
    heavy = act not in LIGHT_ACTIVATIONS
    return config or pick_config(M, N, K, kind, device, INTERPRETED, run, heavy,
                                 x.element_size(), epilogue=act if heavy else "")


def qlinear(
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
    act: str,
    out_dtype: torch.dtype,
    x_scale: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    fast_act: bool = False,
    wrap=None,
    prequantize_fn=None,
) -> torch.Tensor:
    """Fused quantized linear on 2-D ``x`` [M, K] and ``weight`` [N, K]; returns [M, N].

    - ``x`` float with ``x_inv_scale``: static quantization (in the prologue, or by a separate
      pass when the schedule says that is faster — same numbers either way); ``x_inv_scale`` is
      a scalar or one value per input channel (SmoothQuant's prologue vector).
    - ``x`` float without ``x_inv_scale``: dynamic per-token quantization (symmetric).
    - ``x`` int8/fp8: already quantized; ``x_scale`` [M] holds its per-token scales if dynamic.
    ``config`` pins a schedule (tests, tuning); otherwise ``tuning.pick_config`` chooses one
    (no autotuning while traced: the tuned table, the cache, or the first candidate).
    ``fast_act``: hardware erf/exp GELU/SiLU (``common.activation``). ``wrap``: see ``launch``.
    ``prequantize_fn(x)``: where a schedule quantizes a static float x in a separate pass, do it
    with this instead of ``quantize``'s kernel (the traced op passes the reference's torch ops,
    which Inductor fuses into the kernel that produced x).
    """
    from qfuse.kernels.quantize import quantize

    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, out_features(N, act)), device=x.device, dtype=out_dtype)
    if isinstance(M, int) and M == 0:
        return out
    qdtype = weight.dtype
    x_float = not _is_quantized(x)
    if x_float and x_inv_scale is None:  # dynamic: a row's scale needs the whole row first
        x, x_scale = quantize(x, qdtype, None, None, INTERPRETED, wrap=wrap)
        x_float = False

    def run(cfg: GemmConfig) -> torch.Tensor:
        xq = x
        if x_float and cfg.prequantize and prequantize_fn is not None:
            xq = prequantize_fn(x)
        elif x_float and cfg.prequantize:
            xq, _ = quantize(x, qdtype, x_inv_scale, x_zero_point, INTERPRETED, wrap=wrap)
        if wrap is not None and not family(cfg).wraps(x.device):
            # Traced: Inductor cannot yet capture host-side descriptors made inside a
            # triton_op's body, nor pass launch options such as programmatic dependent launch,
            # so such a launch is an opaque op of its own (CUDA-graphed like any other kernel;
            # its descriptors are built at run time).
            return traced_qlinear(xq, weight, scale, x_scale, bias, x_inv_scale, x_zero_point,
                                  weight_sum, residual, out_inv_scale, out_zero_point, act,
                                  out.dtype, cfg, fast_act)
        launch(xq, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum,
               residual, out_inv_scale, out_zero_point, act, out, cfg, fast_act, wrap)
        return out

    tunable = wrap is None  # never time candidates on fake tensors
    return run(_schedule(M, N, K, x, qdtype, x_float, act, x.device, run if tunable else None,
                         config))
