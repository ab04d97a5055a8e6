"""One fused-GEMM launch: the call described once (``gemm_args``: grid, every argument by name
and the launch options, in the MMA kernels' order, then bound to the schedule's family) and
launched (``launch``). ``dispatch`` picks the schedule; ``opaque`` and ``eager`` launch through
here too."""

from __future__ import annotations

import os

import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import ACTIVATION_CODES, LIGHT_ACTIVATIONS
from qfuse.kernels.epilogue import float_grid, output_code
from qfuse.kernels.gemm.families import family
from qfuse.kernels.grid import sm_count, split_k_locks
from qfuse.kernels.schedules import GemmConfig

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
