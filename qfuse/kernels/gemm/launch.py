"""One fused-GEMM launch: the call's kernel arguments, named once (``gemm_args``: grid, every
argument by name and the launch options, in the pointer kernels' order, then bound to the
schedule's family), and the launch (``launch``). ``dispatch`` picks the schedule; ``opaque`` and
``eager`` launch through here too."""

from __future__ import annotations

import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import ACTIVATION_CODES, INTERPRETED, LIGHT_ACTIVATIONS
from qfuse.kernels.epilogue import float_grid, output_code
from qfuse.kernels.gemm.call import GemmCall
from qfuse.kernels.gemm.families import family
from qfuse.kernels.grid import sm_count, split_k_locks
from qfuse.kernels.schedules import GemmConfig


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
    x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None,
    residual: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig, tracing: bool = False,
) -> tuple[tuple[int, int], dict, dict]:
    """Grid, arguments by name and launch options of one launch of ``call`` on ``x`` with
    schedule ``cfg`` into ``out`` [M, N]: in the pointer kernels' order (the 14 pointers and M
    first, what ``eager``'s cached launch passes), then bound to ``cfg``'s family."""
    M, K = x.shape
    N = call.weight.shape[0]
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)  # ceil without triton.cdiv's host cost
    weight, scale, bias, x_inv_scale, x_zp, wsum, out_inv_scale, out_zp = call.pointers
    ws = locks = scale
    if cfg.split_k > 1:
        acc_dtype = torch.float32 if weight.dtype == torch.float8_e4m3fn else torch.int32
        ws = torch.empty((cfg.split_k, M, N), device=x.device, dtype=acc_dtype)
        locks = split_k_locks(x.device, tiles, tracing)
    grid_bits = float_grid(out.dtype)
    res = residual if residual is not None else out
    args = dict(
        x_ptr=x, w_ptr=weight, scale_ptr=scale,
        x_scale_ptr=x_scale if x_scale is not None else scale, bias_ptr=bias,
        x_inv_scale_ptr=x_inv_scale, x_zp_ptr=x_zp, wsum_ptr=wsum, res_ptr=res,
        out_inv_scale_ptr=out_inv_scale, out_zp_ptr=out_zp, out_ptr=out, ws_ptr=ws,
        lock_ptr=locks,
        M=M, N=N, K=K,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wn=weight.stride(0),
        stride_wk=weight.stride(1), stride_rm=res.stride(0), stride_rn=res.stride(1),
        stride_om=out.stride(0), stride_on=out.stride(1),
        FP8=weight.dtype == torch.float8_e4m3fn,
        X_QUANTIZED=_is_quantized(x),
        X_INV_VEC=call.x_inv_scale is not None and call.x_inv_scale.numel() > 1,
        X_ROW_SCALE=x_scale is not None,
        HAS_X_ZP=call.x_zero_point is not None,
        ZP_CORR=call.x_zero_point is not None and call.weight_sum is not None,
        HAS_BIAS=call.bias is not None,
        ACT=ACTIVATION_CODES[call.act],
        HAS_RESIDUAL=residual is not None,
        OUT_Q=output_code(out.dtype),
        HAS_OUT_ZP=call.out_zero_point is not None,
        OUT_MANT=grid_bits[0],
        OUT_EMIN=grid_bits[1],
        EXACT=INTERPRETED,
        FAST_ACT=call.fast_act and call.act not in LIGHT_ACTIVATIONS,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k,
        EPI_SPLIT=cfg.epi_split,
    )
    fam = family(cfg)
    args = fam.bind(args, x, weight, cfg)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    if fam.options is not None:
        options.update(fam.options(args))
    return (_grid0(cfg, tiles, x.device), cfg.split_k), args, options


def launch(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None,
           residual: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig, wrap=None):
    """Launch ``call`` on ``x`` once with schedule ``cfg`` into ``out`` [M, N]; returns what
    Triton's launch returned (the ``CompiledKernel``). ``wrap`` is
    ``torch.library.wrap_triton`` when called from the op's traced CUDA path (so Inductor owns
    the launch), else None."""
    if wrap is not None and not family(cfg).wraps(x.device):
        raise UnsupportedError(f"{family(cfg).name} schedules are launched through their own op "
                               "when traced (dispatch.qlinear routes them)")
    if cfg.tma and (x.stride(1) != 1 or x.stride(0) != x.shape[1] or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)  # a descriptor wants aligned rows
    grid, args, options = gemm_args(x, call, x_scale, residual, out, cfg,
                                    tracing=wrap is not None)
    kernel = wrap(_kernel(cfg)) if wrap is not None else _kernel(cfg)
    return kernel[grid](**args, **options)
