"""LayerNorm + quantize: a LayerNorm read by fused layers that quantize it hands them int8/fp8.

After ``fuse_chains``, a post-LN transformer's ``layer_norm`` output feeds the next GEMMs (Q, K, V;
the FFN's first Linear), which would each quantize it again in their prologue or in a separate
pass, and the next residual add, which needs it in float. ``fuse_layernorm_quant`` replaces the
``aten.layer_norm`` node with ``qfuse::layer_norm_quant``, which writes both in one pass; the
readers then take the quantized tensor (``input_quantized``). It needs the readers to share one
static per-tensor input scale (they read one observer, so they do unless SmoothQuant gave them a
per-channel prologue vector) and one dtype. Used by ``convert`` and by ``load`` (which must build
the same graph from the same modules).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qfuse.fusion.graph_utils import erase_if_dead
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


def fuse_layernorm_quant(gm: fx.GraphModule) -> dict[str, str]:
    """Fuse every eligible LayerNorm; returns {reader layer path: LayerNorm node name}."""
    fused: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.layer_norm.default:
            continue
        args = list(node.args) + [None] * (5 - len(node.args))
        x, shape, weight, bias, eps = args[:5]
        eps = 1e-5 if eps is None else eps
        if len(shape) != 1:
            continue
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
                (x, weight, bias, float(eps), inv, zp, mod.weight.dtype, bool(float_users)),
            )
            y = gm.graph.call_function(operator.getitem, (ln, 0))
            q = gm.graph.call_function(operator.getitem, (ln, 1))
        y.meta["val"] = node.meta.get("val")
        for user, m in readers.items():
            user.update_arg(0, q)
            m._input_quantized = True
            fused[user.target] = node.name
        node.replace_all_uses_with(y)
        erase_if_dead(gm, [node])
        if not float_users:
            erase_if_dead(gm, [y])
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused
