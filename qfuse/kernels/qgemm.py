"""The fused quantized GEMM's launcher: int8 or fp8 e4m3, with the whole epilogue in registers.

    acc[M, N] = x_q @ W_q^T                       (int8: int32 accumulate; fp8: float32)
    y = (acc - zp_x * colsum(W)) * scale[n] [* x_scale[m]] + bias[n]
    out = requant?( (+ residual)( act(y) ) )      (int8 / fp8 with a static scale, or float)

x is float (quantized in the prologue with a static per-tensor scale: no extra pass over HBM),
or already quantized — handed over by the previous fused layer, or by ``quantize.quantize`` with
per-token scales ``x_scale[m]`` (dynamic). W is [N, K] int8 or fp8 with one float32 scale per
output channel, folded with a static activation scale into ``scale[n] = s_x * s_w[n]``.

The kernels live one family a file (``families``: MMA tiles with split-K and their persistent
form, ``mma_gemm``; weight streaming for the smallest M, ``decode_gemm``; TMA descriptor loads,
``tma_gemm``). This module describes one call once (``gemm_args``: every argument by name), binds
it to the family of the schedule ``tuning`` picked, and launches it: plainly, through
``wrap_triton`` when traced, or (a family that tracing cannot capture) through its opaque op.
"""

from __future__ import annotations

import os

import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import ACTIVATION_CODES, LIGHT_ACTIVATIONS, out_features
from qfuse.kernels.epilogue import float_grid, output_code
from qfuse.kernels.families import family
from qfuse.kernels.grid import sm_count, split_k_locks
from qfuse.kernels.schedules import GemmConfig
from qfuse.kernels.tuning import pick_config

# The @triton.jit decorator reads TRITON_INTERPRET when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _grid0(cfg: GemmConfig, tiles, device: torch.device):
    """Programs along the grid's first axis: one per tile, or for a persistent schedule one per
    SM (a program left without a tile exits at once; a fixed count keeps a symbolic M out of
    the grid). The interpreter runs a few persistent programs so each walks several tiles."""
    if not cfg.persistent:
        return tiles
    return sm_count(device) if device.type == "cuda" else 3


def _kernel(cfg: GemmConfig):
    return family(cfg).kernel


def _is_quantized(x: torch.Tensor) -> bool:
    return not x.is_floating_point() or x.dtype == torch.float8_e4m3fn


def gemm_args(
    x, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
    out_inv_scale, out_zero_point, act: str, out: torch.Tensor, cfg: GemmConfig,
    fast_act: bool, tracing: bool = False,
) -> tuple[tuple[int, int], dict, dict]:
    """Grid, arguments by name and launch options of one launch with schedule ``cfg`` into
    ``out`` [M, N]: the call described once in the MMA kernels' order (the 14 pointers and M
    first, what ``qgemm_eager``'s cached launch passes), then bound to ``cfg``'s family."""
    M, K = x.shape
    N = weight.shape[0]
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)  # ceil; triton.cdiv costs ~6 us here
    ws = locks = scale
    if cfg.split_k > 1:
        acc_dtype = torch.float32 if weight.dtype == torch.float8_e4m3fn else torch.int32
        ws = torch.empty((cfg.split_k, M, N), device=x.device, dtype=acc_dtype)
        locks = split_k_locks(x.device, tiles, tracing)
    out_q = output_code(out.dtype)
    grid_bits = float_grid(out.dtype)
    res = residual if residual is not None else out
    dummy = scale
    or_dummy = lambda t: t if t is not None else dummy  # noqa: E731
    args = dict(
        x_ptr=x, w_ptr=weight, scale_ptr=scale, x_scale_ptr=or_dummy(x_scale),
        bias_ptr=or_dummy(bias), x_inv_scale_ptr=or_dummy(x_inv_scale),
        x_zp_ptr=or_dummy(x_zero_point), wsum_ptr=or_dummy(weight_sum), res_ptr=res,
        out_inv_scale_ptr=or_dummy(out_inv_scale), out_zp_ptr=or_dummy(out_zero_point),
        out_ptr=out, ws_ptr=ws, lock_ptr=locks,
        M=M, N=N, K=K,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wn=weight.stride(0),
        stride_wk=weight.stride(1), stride_rm=res.stride(0), stride_rn=res.stride(1),
        stride_om=out.stride(0), stride_on=out.stride(1),
        FP8=weight.dtype == torch.float8_e4m3fn,
        X_QUANTIZED=_is_quantized(x),
        X_INV_VEC=x_inv_scale is not None and x_inv_scale.numel() > 1,
        X_ROW_SCALE=x_scale is not None,
        HAS_X_ZP=x_zero_point is not None,
        ZP_CORR=x_zero_point is not None and weight_sum is not None,
        HAS_BIAS=bias is not None,
        ACT=ACTIVATION_CODES[act],
        HAS_RESIDUAL=residual is not None,
        OUT_Q=out_q,
        HAS_OUT_ZP=out_zero_point is not None,
        OUT_MANT=grid_bits[0],
        OUT_EMIN=grid_bits[1],
        EXACT=INTERPRETED,
        FAST_ACT=fast_act and act not in LIGHT_ACTIVATIONS,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k,
        EPI_SPLIT=cfg.epi_split,
    )
    fam = family(cfg)
    if fam.bind is not None:
        args = fam.bind(args, x, weight, cfg)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    if fam.options is not None:
        options.update(fam.options(args))
    return (_grid0(cfg, tiles, x.device), cfg.split_k), args, options


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    x_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    act: str,
    out: torch.Tensor,
    cfg: GemmConfig,
    fast_act: bool = False,
    wrap=None,
):
    """Launch ``_qlinear_kernel`` once with schedule ``cfg`` into ``out`` [M, N]; returns what
    Triton's launch returned (the ``CompiledKernel``). ``wrap`` is ``torch.library.wrap_triton``
    when called from the op's traced CUDA path (so Inductor owns the launch), else None."""
    if wrap is not None and not family(cfg).wraps(x.device):
        raise UnsupportedError(f"{family(cfg).name} schedules are launched through their own op "
                               "when traced (qgemm.qlinear routes them)")
    if cfg.tma and (x.stride(1) != 1 or x.stride(0) != x.shape[1] or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)  # a descriptor wants aligned rows
    grid, args, options = gemm_args(
        x, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
        out_inv_scale, out_zero_point, act, out, cfg, fast_act, tracing=wrap is not None,
    )
    kernel = wrap(_kernel(cfg)) if wrap is not None else _kernel(cfg)
    return kernel[grid](**args, **options)


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
            from qfuse.kernels.opaque_launch import traced_qlinear

            return traced_qlinear(xq, weight, scale, x_scale, bias, x_inv_scale, x_zero_point,
                                  weight_sum, residual, out_inv_scale, out_zero_point, act,
                                  out.dtype, cfg, fast_act)
        launch(xq, weight, scale, x_scale, bias, x_inv_scale, x_zero_point, weight_sum,
               residual, out_inv_scale, out_zero_point, act, out, cfg, fast_act, wrap)
        return out

    tunable = wrap is None  # never time candidates on fake tensors
    return run(_schedule(M, N, K, x, qdtype, x_float, act, x.device, run if tunable else None,
                         config))
