"""A converted graph rewritten for ``torch.onnx.export``: fused layers as QDQ modules
(``layers``), the quantizing LayerNorm and the int8 max-pool as float ops between
QuantizeLinear / DequantizeLinear, the float gated activation as plain torch ops."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn

from qfuse.errors import UnsupportedError
from qfuse.export.onnx.layers import GATED_ACTIVATIONS, ActivationQParams, QDQConv2d, QDQLinear
from qfuse.fusion.nonfinite import strip_marks
from qfuse.nn import QConv2d, QLinear
from qfuse.nn.base import QuantizedModule
from qfuse.ops.attention import attention_quant_call
from qfuse.ops.layernorm import layer_norm_quant_call
from qfuse.ops.pool import max_pool2d_call

_GATE = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
_LN_QUANT = (layer_norm_quant_call, torch.ops.qfuse.layer_norm_quant.default)
_MAX_POOL = (max_pool2d_call, torch.ops.qfuse.max_pool2d.default)
_ATTENTION = (attention_quant_call, torch.ops.qfuse.attention_quant.default)


def gated_float(y: torch.Tensor, act: str) -> torch.Tensor:
    """``qfuse::gated`` in ops every exporter knows: ``act(y[..., 0::2]) * y[..., 1::2]``."""
    gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
    return _GATE[GATED_ACTIVATIONS[act]](gate) * up


class QDQNorm(nn.Module):
    """``qfuse::layer_norm_quant``: the float LayerNorm / RMSNorm, then QuantizeLinear with the
    readers' input scale. ONNX has no norm with a quantized output; this is the same math with
    the quantization as its own node (ORT and TensorRT compute the norm in float either way)."""

    def __init__(self, eps: float, rms: bool, qparams: ActivationQParams):
        super().__init__()
        self.eps, self.rms, self.qparams = eps, rms, qparams

    def forward(self, x, weight, bias):
        if self.rms:  # transformers' RMSNorm, in its order (as qfuse's reference)
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            y = weight * h.to(x.dtype) if weight is not None else h.to(x.dtype)
        else:
            y = F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        return y, self.qparams.q(y)


class QDQAttention(nn.Module):
    """``qfuse::attention_quant``: float SDPA, the [B, S, H*D] rows, then QuantizeLinear with the
    reading layer's input scale (the unfused graph's ops)."""

    def __init__(self, scale: float, qparams: ActivationQParams):
        super().__init__()
        self.scale, self.qparams = scale, qparams

    def forward(self, q, k, v, mask):
        o = F.scaled_dot_product_attention(q, k, v, mask, scale=self.scale)
        return self.qparams.q(o.transpose(1, 2).flatten(2))


class QDQMaxPool(nn.Module):
    """A max-pool of int8 values: DequantizeLinear -> MaxPool -> QuantizeLinear with the
    producer's output qparams (exact: max-pool commutes with the monotone dequantize), the form
    onnxruntime turns back into an int8 MaxPool. ``args``: aten.max_pool2d's after the input."""

    def __init__(self, args: tuple, qparams: ActivationQParams):
        super().__init__()
        self.args, self.qparams = args, qparams

    def forward(self, x):
        return self.qparams.q(torch.ops.aten.max_pool2d.default(self.qparams.dq(x), *self.args))


class QDQAround(nn.Module):
    """``op`` (a reshape) between DequantizeLinear and QuantizeLinear with one scale: exact, and
    what onnxruntime reduces to the op on int8. A QuantizeLinear -> Reshape -> DequantizeLinear
    chain instead keeps its int8-to-uint8 rewrite (precise mode) from pairing the two, and the
    next GEMM stays float."""

    def __init__(self, op, args: tuple, qparams: ActivationQParams):
        super().__init__()
        self.op, self.args, self.qparams = op, args, qparams

    def forward(self, x):
        return self.qparams.q(self.op(self.qparams.dq(x), *self.args))


# Ops a quantization commutes with (monotone or pure data movement): Q(op(y)) == op(Q(y)).
_COMMUTING = {torch.ops.aten.max_pool2d.default, torch.ops.aten.flatten.using_ints,
              torch.ops.aten.view.default, torch.ops.aten.reshape.default, "flatten", "view",
              "reshape"}


def _hoist_quantize(gm: fx.GraphModule, notes: list) -> None:
    """A fused layer that quantizes a float input coming from a fused conv's float output
    through max-pools and reshapes only (a CNN's conv -> pool -> flatten -> Linear) gets that
    QuantizeLinear at the conv's output instead: exact (quantization commutes with both), and
    the conv then ends in a QuantizeLinear, which onnxruntime runs as QLinearConv."""
    for node in list(gm.graph.nodes):
        reader = gm.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(reader, QDQLinear | QDQConv2d) or reader.input_quantized:
            continue
        if reader.x is None or getattr(reader, "smooth", None) is not None:
            continue
        chain, src = [], node.args[0]
        while (isinstance(src, fx.Node) and src.op in ("call_function", "call_method")
               and src.target in _COMMUTING and len(src.users) == 1):
            chain.append(src)
            src = src.args[0]
        producer = gm.get_submodule(src.target) if (
            chain and isinstance(src, fx.Node) and src.op == "call_module") else None
        if (not isinstance(producer, QDQConv2d) or producer.out is not None
                or len(src.users) != 1 or producer.qdtype != reader.qdtype
                or producer.out_dtype != torch.float32):
            continue
        producer.out = copy.deepcopy(reader.x)  # the reader's own scale and zero point
        reader.input_quantized = True
        for i, op in enumerate(chain):
            fn = getattr(torch.Tensor, op.target) if isinstance(op.target, str) else op.target
            name = f"qdq_hoisted_{i}_{node.name}"
            gm.add_module(name, QDQAround(fn, tuple(op.args[1:]), producer.out))
            with gm.graph.inserting_before(op):
                new = gm.graph.call_module(name, (op.args[0],))
            op.replace_all_uses_with(new)
            gm.graph.erase_node(op)
        notes.append(f"{src.target}: the float output {node.target} quantizes (through "
                     "max-pool / reshape) is quantized at the conv instead, with the same scale "
                     "(exact: quantization commutes with them)")


def _module_of_attr(gm: fx.GraphModule, node, what: str, suffix: str):
    if not (isinstance(node, fx.Node) and node.op == "get_attr" and node.target.endswith(suffix)):
        raise UnsupportedError(f"{what}: its quantization scale is not a layer's {suffix} "
                               "buffer; export_onnx cannot find the scale to write.")
    return gm.get_submodule(node.target[: -len(suffix)])


def _pool_qparams(gm, node) -> ActivationQParams:
    src = node.args[0]
    mod = gm.get_submodule(src.target) if src.op == "call_module" else None
    if not isinstance(mod, QDQConv2d) or mod.out is None:
        raise UnsupportedError(
            f"{node.name}: an int8 max-pool whose input is not a fused conv's int8 output; "
            "export_onnx cannot find its scale. Convert with fuse_pools=False.")
    return mod.out


def rewrite(gm: fx.GraphModule, act_dtype: torch.dtype) -> tuple[fx.GraphModule, list, list]:
    """A copy of converted ``gm`` with every qfuse layer and op in ONNX-exportable form.

    Returns ``(graph, layers, notes)``: ``layers`` the (name, QDQ module) of every fused layer
    in graph order, ``notes`` what was written as a nearest equivalent.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gm = copy.deepcopy(gm)
    layers, notes = [], []
    if strip_marks(gm):
        notes.append("NaN/Inf marks (qfuse.fusion.nonfinite) are not written: in the ONNX graph "
                     "a non-finite input quantizes to a finite code, as in any int8 engine")
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if isinstance(mod, QLinear):
            new = QDQLinear(mod, node.target, act_dtype)
        elif isinstance(mod, QConv2d):
            new = QDQConv2d(mod, node.target, act_dtype)
        elif isinstance(mod, QuantizedModule):
            raise UnsupportedError(f"layer {node.target}: {type(mod).__name__} has no ONNX "
                                   "export; export_onnx writes QLinear and QConv2d layers.")
        else:
            continue
        parent, _, leaf = node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, new)
        layers.append((node.target, new))
        notes.extend(new.notes)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LN_QUANT:
            x, weight, bias, eps, inv, _zp, qdtype, _write_y, *rest = node.args
            reader = _module_of_attr(gm, inv, f"quantizing norm {node.name}", ".x_inv_scale")
            qparams = reader.x
            count += 1
            name = f"qdq_norm_{count}"
            gm.add_module(name, QDQNorm(eps, bool(rest[0]) if rest else False, qparams))
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (x, weight, bias))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            for arg in (inv, _zp):  # the swapped-out layer's buffers
                if isinstance(arg, fx.Node) and not arg.users:
                    gm.graph.erase_node(arg)
            notes.append(f"{node.name}: norm -> int8 hand-off written as float norm + "
                         "QuantizeLinear (ONNX has no norm with a quantized output)")
        elif node.target in _ATTENTION:
            q, k, v, mask, scale, inv, _zp, _qdtype = node.args
            reader = _module_of_attr(gm, inv, f"quantizing attention {node.name}", ".x_inv_scale")
            count += 1
            name = f"qdq_attention_{count}"
            gm.add_module(name, QDQAttention(scale, reader.x))
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (q, k, v, mask))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            for arg in (inv, _zp):
                if isinstance(arg, fx.Node) and not arg.users:
                    gm.graph.erase_node(arg)
        elif node.target in _MAX_POOL:
            x, *pool_args = node.args
            count += 1
            name = f"qdq_pool_{count}"
            gm.add_module(name, QDQMaxPool(tuple(pool_args), _pool_qparams(gm, node)))
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (x,))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        elif node.target is torch.ops.qfuse.gated.default:
            node.target = gated_float
        elif str(getattr(node.target, "namespace", "")) == "qfuse":
            raise UnsupportedError(f"{node.name}: qfuse op {node.target} has no ONNX export.")
    _hoist_quantize(gm, notes)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, layers, notes
