"""Fold eval-mode BatchNorm2d into the Conv2d that feeds it, in the captured graph.

``w' = w * g / sqrt(var + eps)`` per output channel and
``b' = (b - mean) * g / sqrt(var + eps) + beta``,
computed in float64 and stored in the weight's dtype, so the quantized conv sees the folded weight
(whose per-channel range is what the int8 scale must cover).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qfuse.fusion.graph_utils import attr_tensor, erase_if_dead

aten = torch.ops.aten
_BN_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)


def _get(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if node is None:
        return None
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise ValueError("not a parameter")
    return attr_tensor(gm, node.target)


def _bn_output(bn: fx.Node) -> fx.Node | None:
    """The node carrying the normalised tensor (a getitem for the tuple-returning variant)."""
    if bn.target == aten.batch_norm.default:
        return bn
    getters = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
    return getters[0] if len(getters) == 1 and len(bn.users) == 1 else None


def fold_conv_bn(weight, bias, gamma, beta, mean, var, eps: float):
    """The folded ``(weight, bias)`` in the weight's dtype (float64 inside). Differentiable: QAT
    trains through it (qfuse/flows/qat/conv_bn.py), and convert folds with this same function."""
    inv_std = torch.rsqrt(var.double() + eps)
    g = gamma.double() * inv_std if gamma is not None else inv_std
    new_w = (weight.double() * g.reshape(-1, 1, 1, 1)).to(weight.dtype)
    b = bias.double() if bias is not None else torch.zeros_like(mean, dtype=torch.float64)
    new_b = (b - mean.double()) * g + (beta.double() if beta is not None else 0.0)
    return new_w, new_b.to(weight.dtype)


def fold_batchnorm(gm: fx.GraphModule) -> list[str]:
    """Fold every ``conv2d -> batch_norm(eval)`` pair in place; returns the folded BN targets."""
    folded = []
    for conv in list(gm.graph.nodes):
        if conv.op != "call_function" or conv.target != aten.conv2d.default or len(conv.users) != 1:
            continue
        bn = next(iter(conv.users))
        if bn.op != "call_function" or bn.target not in _BN_OPS or bn.args[0] is not conv:
            continue
        if bn.target == aten.batch_norm.default and bn.args[5] is not False:
            continue  # training-mode BN normalises with batch statistics: not foldable
        out = _bn_output(bn)
        if out is None or conv.args[1].op != "get_attr" or len(conv.args[1].users) != 1:
            continue
        try:
            gamma, beta, mean, var = (_get(gm, a) for a in bn.args[1:5])
            weight = _get(gm, conv.args[1])
            bias = _get(gm, conv.args[2] if len(conv.args) > 2 else None)
        except ValueError:
            continue
        eps = bn.args[7] if bn.target == aten.batch_norm.default else bn.args[6]
        new_w, new_b = fold_conv_bn(weight, bias, gamma, beta, mean, var, eps)
        w_target = conv.args[1].target
        b_target = (
            w_target[: -len("weight")] + "folded_bias"
            if w_target.endswith("weight")
            else (w_target + "_folded_bias")
        )
        owner, _, leaf = w_target.rpartition(".")
        owner_mod = gm.get_submodule(owner) if owner else gm
        setattr(owner_mod, leaf, torch.nn.Parameter(new_w, requires_grad=False))
        b_owner, _, b_leaf = b_target.rpartition(".")
        (gm.get_submodule(b_owner) if b_owner else gm).register_parameter(
            b_leaf, torch.nn.Parameter(new_b.to(weight.dtype), requires_grad=False)
        )
        with gm.graph.inserting_before(conv):
            b_node = gm.graph.get_attr(b_target)
        args = list(conv.args) + [None] * (3 - len(conv.args))
        old_bias, args[2] = args[2], b_node
        conv.args = tuple(args)
        folded.append(bn.args[1].target if isinstance(bn.args[1], fx.Node) else bn.name)
        out.replace_all_uses_with(conv)
        erase_if_dead(
            gm, ([out, bn] if out is not bn else [bn]) + [old_bias] * (old_bias is not None)
        )
    gm.recompile()
    return folded
