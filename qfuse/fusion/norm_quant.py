"""Norm + quantize: a LayerNorm or RMSNorm read by fused layers that quantize it hands them
int8/fp8.

After ``fuse_chains``, a post-LN transformer's ``layer_norm`` output feeds the next GEMMs (Q, K, V;
the FFN's first Linear), which would each quantize it again in their prologue or in a separate
pass, and the next residual add, which needs it in float. ``fuse_layernorm_quant`` replaces the
``aten.layer_norm`` node with ``qfuse::layer_norm_quant``, which writes both in one pass; the
readers then take the quantized tensor (``input_quantized``). It needs the readers to share one
static per-tensor input scale (they read one observer, so they do unless SmoothQuant gave them a
per-channel prologue vector) and one dtype. Pre-norm LLMs (Llama, Qwen2, Mistral) get the same for
transformers' RMSNorm, which export records as its elementwise ops (``match_rms_norm`` matches them;
SmoothQuant uses it too, to find the RMSNorm it folds its factors into).
Used by ``convert`` and by ``load`` (which must build the same graph from the same modules).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qfuse.fusion.graph_utils import attr_tensor, erase_if_dead
from qfuse.fusion.patterns import is_eval_identity
from qfuse.ops.layernorm import layer_norm_quant_call

aten = torch.ops.aten


def _static_reader(gm: fx.GraphModule, user: fx.Node, node: fx.Node):
    from qfuse.nn import QLinear

    if user.op != "call_module" or not user.args or user.args[0] is not node:
        return None
    mod = gm.get_submodule(user.target)
    if not isinstance(mod, QLinear) or mod.x_inv_scale is None or mod.x_inv_scale.numel() != 1:
        return None
    return mod


def _layer_norm(node: fx.Node):
    """``(x, weight, bias, eps, rms, nodes)`` of an ``aten.layer_norm`` over the last dim."""
    if node.target is not aten.layer_norm.default:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    x, shape, weight, bias, eps = args[:5]
    if len(shape) != 1:
        return None
    return x, weight, bias, 1e-5 if eps is None else eps, False, [node]


_CASTS = (aten.to.dtype, aten._to_copy.default)


def _other(node: fx.Node, arg: fx.Node):
    a, b = node.args[:2]
    return b if a is arg else a if b is arg else None


def match_rms_norm(node: fx.Node):
    """``(x, weight, None, eps, True, nodes)`` when ``node`` is the final multiply of
    transformers' RMSNorm as export records it (``weight * (x32 * rsqrt(x32.pow(2).mean(-1,
    keepdim=True) + eps)).to(dtype)``, x32 = ``x.to(float32)``; ``weight`` a get_attr node), else
    None. The one RMSNorm matcher: the norm fusion here and SmoothQuant's selection use it."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    weight = next((a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
    h = _other(node, weight) if weight is not None else None
    if not isinstance(h, fx.Node):
        return None
    cast = h if h.target in _CASTS else None
    h_mul = cast.args[0] if cast is not None else h
    if not isinstance(h_mul, fx.Node) or h_mul.target is not aten.mul.Tensor:
        return None
    rsqrt = next((a for a in h_mul.args if isinstance(a, fx.Node)
                  and a.target is aten.rsqrt.default), None)
    x32 = _other(h_mul, rsqrt) if rsqrt is not None else None
    add = rsqrt.args[0] if rsqrt is not None else None
    if not isinstance(x32, fx.Node) or not isinstance(add, fx.Node) or add.target not in (
        aten.add.Tensor, aten.add.Scalar
    ):
        return None
    mean, eps = add.args[:2]
    if not isinstance(eps, float) or not isinstance(mean, fx.Node) or (
        mean.target is not aten.mean.dim
    ):
        return None
    power = mean.args[0]
    dims = list(mean.args[1]) if len(mean.args) > 1 else []
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    val = x32.meta.get("val")
    if not isinstance(val, torch.Tensor) or dims not in ([-1], [val.dim() - 1]) or not keep:
        return None
    if power.target is not aten.pow.Tensor_Scalar or power.args[0] is not x32 or (
        power.args[1] != 2
    ):
        return None
    x = x32.args[0] if x32.target in _CASTS else x32
    x_val, out_val = x.meta.get("val"), node.meta.get("val")
    w = attr_tensor(node.graph.owning_module, weight.target)
    if not isinstance(x_val, torch.Tensor) or not isinstance(out_val, torch.Tensor):
        return None
    if w.dim() != 1 or out_val.dtype != x_val.dtype or w.dtype != x_val.dtype:
        return None  # the fused kernel writes y in x's dtype
    if cast is None and x_val.dtype != torch.float32:
        return None
    chain = [node] + ([cast] if cast is not None else []) + [h_mul, rsqrt, add, mean, power]
    if x32 is not x:
        chain.append(x32)
    return x, weight, None, eps, True, chain


def fuse_layernorm_quant(gm: fx.GraphModule) -> dict[str, str]:
    """Fuse every eligible LayerNorm or RMSNorm; returns {reader layer path: "LayerNorm (node)"}."""
    fused: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        norm = _layer_norm(node) or match_rms_norm(node)
        if norm is None:
            continue
        x, weight, bias, eps, rms, chain = norm
        for user in list(node.users):  # eval-mode dropout after the embeddings' LayerNorm
            if is_eval_identity(user):
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
        readers = {u: m for u in node.users if (m := _static_reader(gm, u, node)) is not None}
        keys = {(m.weight.dtype, float(m.x_inv_scale),
                 int(m.x_zero_point) if m.x_zero_point is not None else 0)
                for m in readers.values()}
        if len(keys) != 1:
            continue
        first = next(iter(readers))
        mod = readers[first]
        float_users = [u for u in node.users if u not in readers or node in u.kwargs.values()]
        with gm.graph.inserting_before(node):
            inv = gm.graph.get_attr(f"{first.target}.x_inv_scale")
            zp = (gm.graph.get_attr(f"{first.target}.x_zero_point")
                  if mod.x_zero_point is not None else None)
            ln = gm.graph.call_function(
                layer_norm_quant_call,
                (x, weight, bias, float(eps), inv, zp, mod.weight.dtype, bool(float_users), rms),
            )
            y = gm.graph.call_function(operator.getitem, (ln, 0))
            q = gm.graph.call_function(operator.getitem, (ln, 1))
        y.meta["val"] = node.meta.get("val")
        for user, m in readers.items():
            user.update_arg(0, q)
            m._input_quantized = True
            fused[user.target] = f"{'RMSNorm' if rms else 'LayerNorm'} ({node.name})"
        node.replace_all_uses_with(y)
        erase_if_dead(gm, chain)
        if not float_users:
            erase_if_dead(gm, [y])
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused
