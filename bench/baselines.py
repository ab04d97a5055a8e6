"""The implementations a user has today without qfuse, built per shape, each a zero-arg callable.

Quantized baselines use the same numerics as qfuse: per-output-channel symmetric weights; static
per-tensor activation scales for ``_int_mm``/``_scaled_mm`` (what qfuse's static kernels do, so the
difference measured is the fusion, not the scheme) and torchao's own dynamic schemes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench import harness

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

ACTS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "none": lambda y: y,
}


def static_scale(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per-tensor symmetric activation scale from the data itself (perfect calibration)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    return amax / (127.5 if dtype == "int8" else FP8_MAX)


def quantize_weight(w: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K], per-channel float32 scale [N])."""
    amax = w.abs().amax(dim=1).float().clamp_min(1e-12)
    if dtype == "int8":
        s = amax / 127.0
        return torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8), s
    s = amax / FP8_MAX
    return (w.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def _q_act(x: torch.Tensor, inv: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "int8":
        return torch.round(x.float() * inv).clamp(-128, 127).to(torch.int8)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def int_mm_linear(wq, ws, bias, act):
    """int8 static: quantize x, ``torch._int_mm``, float epilogue — unfused, as eager code does.

    The call is ``fn(x, x_scale)``: the scale is an argument, so one compiled graph serves all M.
    """
    wt = wq.t()

    def fn(x, x_scale):
        acc = torch._int_mm(_q_act(x, 1.0 / x_scale, "int8"), wt)
        return ACTS[act](acc.float() * (x_scale * ws) + bias.float()).to(x.dtype)

    return fn


def scaled_mm_linear(wq, ws, bias, act):
    """fp8 static tensor scale (broadcast rowwise) through ``torch._scaled_mm``, bias inside."""
    wt, sb = wq.t(), ws[None, :].contiguous()

    def fn(x, x_scale):
        sa = x_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        y = torch._scaled_mm(
            _q_act(x, 1.0 / x_scale, "fp8"), wt, scale_a=sa, scale_b=sb, bias=bias,
            out_dtype=x.dtype,
        )
        return ACTS[act](y)

    return fn


def torchao_module(linears: list[nn.Module], dtype: str) -> None:
    """Quantize the given bf16 modules in place with torchao's dynamic int8 / fp8 per-row config.
    Inductor's settings stay as they are (``harness.torchao_quantize``): the GEMM and MLP benches
    compile every row, torchao's included, with Inductor's defaults."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
    )

    cfg = (
        Int8DynamicActivationInt8WeightConfig()
        if dtype == "int8"
        else Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    )
    for mod in linears:
        harness.torchao_quantize(mod, cfg)  # Inductor's settings left alone (see harness)


def built_once(fns: dict, name: str, build: Callable[[], Callable]) -> Callable:
    """``fns[name]``, built by ``build()`` on first use (one compile per weight shape). A build
    that failed (e.g. torchao missing) is kept and raised again at each use: every row that
    needs it records the error."""
    if name not in fns:
        try:
            fns[name] = build()
        except Exception as exc:  # noqa: BLE001 — raised again below, per row
            fns[name] = exc
    if isinstance(fns[name], Exception):
        raise fns[name]
    return fns[name]


def compiled(fn: Callable) -> Callable:
    """Default-mode ``torch.compile``, as a user gets it: the first M compiles static, the next
    one recompiles with M dynamic (automatic dynamic shapes), later M reuse that graph. Callers
    build one per (K, N) and reset dynamo between weight shapes."""
    return torch.compile(fn)
