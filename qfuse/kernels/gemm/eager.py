"""Eager CUDA calls of the fused GEMM through cached compiled kernels (``launcher.CachedLaunch``).

A plain ``dispatch.qlinear`` call spends more host time than a decode-sized kernel runs (Triton
binds and specializes every argument per launch). Per layer and M bucket, a ``_Plan`` keeps the
chosen schedule and the compiled kernels of a first ordinary call, checked once against that
call, and then launches them directly with the layer's ``GemmCall``.
"""

from __future__ import annotations

import torch

from qfuse.kernels import quantize as qz
from qfuse.kernels.gemm.call import GemmCall
from qfuse.kernels.gemm.dispatch import qlinear, schedule
from qfuse.kernels.gemm.families import family
from qfuse.kernels.gemm.launch import _grid0, _is_quantized, _kernel, gemm_args, launch
from qfuse.kernels.grid import split_k_locks
from qfuse.kernels.launcher import build, raw_stream
from qfuse.kernels.schedules import m_bucket


class _Plan:
    """What the eager hot path needs per layer and M bucket: the schedule and its kernels as
    ``CachedLaunch``es (the quantize pre-pass, if any, and the GEMM)."""

    __slots__ = ("cfg", "quant", "gemm", "N", "N_out", "K", "qdtype", "out_dtype", "dynamic")

    def __call__(self, x: torch.Tensor, call: GemmCall, residual: torch.Tensor | None):
        M = x.shape[0]
        dev = x.device
        stream = raw_stream(dev)
        x_scale = None
        if self.quant is not None:
            q = x.new_empty((M, self.K), dtype=self.qdtype)
            if self.dynamic:
                x_scale = x.new_empty((M,), dtype=torch.float32)
                self.quant(-(-M // 4), 1, stream, x, x_scale, x_scale, q, x_scale, M)
            else:
                inv = call.x_inv_scale
                zp = call.x_zero_point if call.x_zero_point is not None else inv
                self.quant(-(-M // 4), 1, stream, x, inv, zp, q, inv, M)
            x = q
        cfg = self.cfg
        out = x.new_empty((M, self.N_out), dtype=self.out_dtype)
        tiles = -(-M // cfg.block_m) * -(-self.N // cfg.block_n)
        weight, scale, bias, x_inv_scale, x_zp, wsum, out_inv_scale, out_zp = call.pointers
        ws = locks = scale
        if cfg.split_k > 1:
            ws = torch.empty((cfg.split_k, M, self.N), device=dev,
                             dtype=torch.float32 if self.qdtype != torch.int8 else torch.int32)
            locks = split_k_locks(dev, tiles, False)
        self.gemm(
            _grid0(cfg, tiles, dev), cfg.split_k, stream,
            x, weight, scale, x_scale if x_scale is not None else scale, bias, x_inv_scale, x_zp,
            wsum, residual if residual is not None else out, out_inv_scale, out_zp,
            out, ws, locks, M,
        )
        return out


def _build_plan(x: torch.Tensor, call: GemmCall, residual: torch.Tensor | None):
    """Run one call the ordinary way (choosing, maybe autotuning, the schedule), launch the same
    kernels again to keep their compiled handles, and check that launching those directly gives
    the same output. Returns ``(plan or None, why not, output)``."""
    out = qlinear(x, call, None, residual)
    M, K = x.shape
    qdtype = call.weight.dtype
    dynamic = not _is_quantized(x) and call.x_inv_scale is None
    x_float = not _is_quantized(x) and not dynamic
    cfg = schedule(x, call, x_float=x_float)
    if not family(cfg).cached_eager:  # e.g. TMA: descriptors hold x's address, built per call
        return None, f"plain launch ({family(cfg).name} schedule)", out
    xg, x_scale, quant = x, None, None
    if dynamic or (x_float and cfg.prequantize):
        inv = None if dynamic else call.x_inv_scale
        xg, x_scale, compiled_q, q_args = qz.quantize_with_args(x, qdtype, inv,
                                                               call.x_zero_point)
        quant = build(compiled_q, qz._quantize_kernel, q_args, 6)
        x_scale = x_scale if dynamic else None
    _, g_args, _ = gemm_args(xg, call, x_scale, residual, torch.empty_like(out), cfg)
    compiled_g = launch(xg, call, x_scale, residual, g_args["out_ptr"], cfg)
    gemm = build(compiled_g, _kernel(cfg), g_args, 15)
    for why in (gemm, quant):
        if isinstance(why, str):
            return None, why, out
    plan = _Plan()
    plan.cfg, plan.quant, plan.gemm, plan.N, plan.K = cfg, quant, gemm, call.weight.shape[0], K
    plan.N_out = call.out_features
    plan.qdtype, plan.out_dtype, plan.dynamic = qdtype, call.out_dtype, dynamic
    try:
        again = plan(x, call, residual)
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
        same = torch.equal(bits(again), bits(out))
    except Exception as exc:  # noqa: BLE001 — a launcher that takes other arguments
        return None, f"plain launch (direct launch failed: {type(exc).__name__}: {exc})", out
    if not same:
        return None, "plain launch (direct launch disagreed with Triton's own launch)", out
    return plan, None, out


def qlinear_eager(cache: dict, x: torch.Tensor, call: GemmCall, residual: torch.Tensor | None,
                  check) -> torch.Tensor:
    """``dispatch.qlinear`` for plain eager CUDA calls on 2-D ``x``, launching cached compiled
    kernels.

    ``cache`` is owned by the calling layer: one ``_Plan`` per (M bucket, x dtype, residual
    dtype, call variant), built on the first call of its key (outside CUDA-graph capture, after
    ``check(x, call, None)`` validated the arguments) and checked against Triton's own launch.
    When that check fails the reason is kept under ``cache["plain"]`` (``qfuse.summary`` shows
    it) and every call takes the ordinary launch. A hit skips the argument checks: the key pins
    every dtype the plan was checked with, and the caller has checked K.
    """
    M = x.shape[0]
    # Everything a plan's compiled kernels were specialized on that a caller may change
    # between calls (the layer's other attributes are fixed by its buffers' identity).
    key = (m_bucket(M), x.dtype, residual.dtype if residual is not None else None, call.variant)
    plan = cache.get(key)
    if (plan is not None and x.is_contiguous() and x.data_ptr() % 16 == 0
            and (residual is None or (residual.is_contiguous() and residual.data_ptr() % 16 == 0
                                      and residual.shape == (M, plan.N_out)))):
        return plan(x, call, residual)
    check(x, call, None)
    if (plan is not None or "plain" in cache or M == 0 or not x.is_contiguous()
            or torch.cuda.is_current_stream_capturing()):
        return qlinear(x, call, None, residual)
    plan, why, out = _build_plan(x, call, residual)
    if plan is None:
        cache["plain"] = why
    else:
        cache[key] = plan
    return out
