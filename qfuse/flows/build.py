"""What ``convert`` (the fused graph) and ``swap`` (the user's own model) share: one quantized
module built per chain from the per-layer plan (``build``), and the record ``summary`` and
``save`` report for it (``record``)."""

from __future__ import annotations

import torch

from qfuse.config import PerChannel
from qfuse.errors import UnsupportedError
from qfuse.flows.plan import LayerPlan
from qfuse.fusion.patterns import Chain
from qfuse.nn import QConv2d, QLinear
from qfuse.nn.qlinear4 import QLinear4
from qfuse.state import LayerRecord


def build(chain: Chain, config, plan: LayerPlan, out_qparams, input_quantized, out_dtype,
          residual_qparams=None):
    """The ``QLinear`` / ``QConv2d`` for ``chain``: its weights, scales and epilogue from
    ``plan``; ``out_qparams`` set when it requantizes for the next layer."""
    if config.weight_bits == 4:
        return build4(chain, config, plan)
    scale, zp = plan.x_qparams[chain.name]
    out_scale, out_zp = out_qparams if out_qparams else (None, None)
    res_scale, res_zp = residual_qparams if residual_qparams else (None, None)
    prologue = plan.prologue.get(chain.name)
    dtype = plan.dtypes[chain.name]
    fp8 = dtype == torch.float8_e4m3fn
    if fp8:
        # Observers give the symmetric int8 scale amax / 127.5; fp8 e4m3 spans amax / 448.
        to_fp8 = 127.5 / 448.0
        scale = scale * to_fp8 if scale is not None else None  # None: dynamic, uncalibrated
        out_scale = out_scale * to_fp8 if out_scale is not None else None
        res_scale, res_zp = (res_scale * to_fp8 if res_scale is not None else None), None
        prologue = prologue / to_fp8 if prologue is not None else None
        out_dtype = torch.float8_e4m3fn if out_dtype == torch.int8 else out_dtype
    if chain.name in plan.dynamic:
        if prologue is not None:
            raise UnsupportedError(
                f"layer {chain.name}: SmoothQuant's prologue vector needs a static activation "
                "scale; use a static QConfig or let SmoothQuant fold into the producer."
            )
        # Per-token scales need the whole row, so chains hand over float32 (plan weights are
        # float32) and each layer quantizes its input on entry.
        scale, zp, input_quantized, out_scale, out_zp = None, None, False, None, None
        out_dtype = torch.float32 if out_dtype in (torch.int8, torch.float8_e4m3fn) else out_dtype
    common = dict(
        x_scale=scale,
        x_zero_point=zp,
        per_channel=isinstance(config.weight_granularity, PerChannel),
        weight_scale=plan.weight_scales.get(chain.name),
        activation=chain.activation,
        input_quantized=input_quantized,
        out_scale=out_scale,
        out_zero_point=out_zp,
        out_dtype=out_dtype,
    )
    weight, bias = plan.weights[chain.name], plan.biases[chain.name]
    if chain.kind == "linear":
        module = QLinear.from_float(weight, bias, dtype=dtype, **common)
    else:
        module = QConv2d.from_float(
            weight, bias, **chain.conv, dtype=dtype, post_activation=chain.post_activation,
            residual_scale=res_scale, residual_zero_point=res_zp, **common,
        )
    if prologue is not None:
        module.x_inv_scale = prologue.to(module.weight.device)
    return module


def build4(chain: Chain, config, plan: LayerPlan) -> QLinear4:
    """The 4-bit ``QLinear4`` for ``chain`` (float in, float out: no int8 hand-off)."""
    if chain.kind != "linear":
        raise UnsupportedError(
            f"layer {chain.name}: 4-bit weights cover Linear layers; keep this {chain.kind} "
            f"float (convert(keep_float={{{chain.name!r}: ...}})) or quantize it to int8.")
    if chain.name in plan.prologue:
        raise UnsupportedError(
            f"layer {chain.name}: SmoothQuant left its factors as a prologue vector, which 4-bit "
            "layers do not apply; smooth only layers fed by an RMSNorm or a producer Linear "
            "(SmoothQuant(layers=...)).")
    x_scale = None
    if not config.weight_only and not config.is_dynamic:
        x_scale = plan.x_qparams[chain.name][0]
    return QLinear4.from_float(
        plan.weights[chain.name], plan.biases[chain.name], group_size=config.group_size,
        symmetric=config.weight_symmetric, act_bits=16 if config.weight_only else 8,
        x_scale=x_scale, activation=chain.activation,
        qparams=plan.weight_scales.get(chain.name), name=chain.name)


def precision4(module: QLinear4) -> str:
    """How summary names a 4-bit layer: ``w4a16 g128``, ``w4a8 g64 asym``, ``w4a16 per-channel``."""
    group = f"g{module.group_size}" if module.group_size else "per-channel"
    zp = " asym" if module.weight_zero_point is not None else ""
    return f"w4a{module.act_bits} {group}{zp}"


QUANT_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}


def record(chain: Chain, module, path: str, producer, readers, notes,
           res_readers=()) -> LayerRecord:
    """What summary and save report for a fused layer, read off the module actually built."""
    if isinstance(module, QLinear4):
        source = "float"
        if module.act_bits == 8:
            source = ("float → int8 per token (dynamic)" if module.dynamic
                      else "float → int8 in prologue")
        return LayerRecord(name=path, pattern=chain.pattern, kind=chain.kind,
                           precision=precision4(module), input=source, output="float",
                           note="; ".join(notes))
    qname = QUANT_NAMES[module.weight.dtype]
    if module.input_quantized:
        source = f"{qname} from {producer}"
    elif module.x_scale is None:
        source = f"float → {qname} per {'token' if chain.kind == 'linear' else 'tensor'} (dynamic)"
    else:
        source = f"float → {qname} in prologue"
    if module.out_dtype in QUANT_NAMES:
        names = [r.name for r in readers] + [f"{r.name} (residual)" for r in res_readers]
        sink = f"{QUANT_NAMES[module.out_dtype]} to {', '.join(names)}"
    else:
        sink = str(module.out_dtype).replace("torch.", "")
    return LayerRecord(
        name=path,
        pattern=chain.pattern,
        kind=chain.kind,
        precision=qname,
        input=source,
        output=sink,
        note="; ".join(notes),
    )
