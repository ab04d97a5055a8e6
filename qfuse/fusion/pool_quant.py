"""Conv -> max-pool -> fused readers: the pool runs on the conv's int8/fp8 output.

A ResNet stem (``conv -> bn -> relu -> maxpool``) ends in a max-pool that the chain matcher
cannot take in (it is no activation or residual), so after ``fuse_chains`` the stem conv writes
float, ATen pools in float (a large share of the stem's time: the pool reads and writes the
full-resolution float tensor), and the readers quantize again. Quantization is monotonic, so
``max(q(x)) == q(max(x))``: the conv can requantize with its readers' input scale and
``qfuse::max_pool2d`` pools the int8/fp8 values.
``fuse_maxpool_quant`` does that when every reader of the pool is a fused conv reading it as its
input (one shared scale and dtype) or as its residual. Used by ``convert`` and by ``load``: a
conv loaded with a quantized output before a max-pool gets the same graph back.
"""

from __future__ import annotations

import torch
from torch import fx

from qfuse.ops.pool import max_pool2d_call

aten = torch.ops.aten
QUANTIZED = (torch.int8, torch.float8_e4m3fn)


def _pool_args(node: fx.Node):
    if node.op != "call_function" or node.target is not aten.max_pool2d.default:
        return None
    pair = lambda v: [int(v[0]), int(v[-1])]  # noqa: E731 - one-liner normaliser
    args = list(node.args) + [None] * (6 - len(node.args))
    x, kernel, stride, padding, dilation, ceil = args[:6]
    kernel = pair(kernel)
    stride = pair(stride) if stride else kernel  # F.max_pool2d's default stride is the kernel
    return (x, kernel, stride, pair(padding or [0]), pair(dilation or [1]),
            bool(ceil or node.kwargs.get("ceil_mode", False)))


def _module(gm, node, cls):
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    return mod if isinstance(mod, cls) else None


def fuse_maxpool_quant(gm: fx.GraphModule) -> dict[str, tuple[str, list[str]]]:
    """Pool quantized where a fused conv feeds a max-pool read only by fused convs; returns
    {producer path: (pool node name, [reader paths])} for the pools changed at convert."""
    from qfuse.nn import QConv2d

    changed = {}
    for node in list(gm.graph.nodes):
        pool = _pool_args(node)
        producer = _module(gm, pool[0], QConv2d) if pool else None
        if producer is None or len(pool[0].users) != 1:
            continue
        if producer.out_dtype not in QUANTIZED and not _requantize(gm, node, producer, changed):
            continue
        node.target = max_pool2d_call
        node.args, node.kwargs = pool, {}
    if changed:
        gm.graph.lint()
        gm.recompile()
    elif any(n.target is max_pool2d_call for n in gm.graph.nodes):
        gm.recompile()
    return changed


def _requantize(gm, node, producer, changed) -> bool:
    """Make ``producer`` write its pool readers' quantized input; False when they disagree or
    another op reads the pool."""
    from qfuse.nn import QConv2d

    inputs, residuals = [], []
    for user in node.users:
        mod = _module(gm, user, QConv2d)
        if mod is None:
            return False
        if user.args and user.args[0] is node and node not in user.kwargs.values():
            inputs.append((user, mod))
        elif user.kwargs.get("residual") is node and (not user.args or user.args[0] is not node):
            residuals.append((user, mod))
        else:
            return False
    if not inputs:
        return False
    keys = set()
    for _, m in inputs:  # static per-tensor input scales only (no SmoothQuant prologue vector)
        if m.x_scale is None or m.x_inv_scale is None or m.x_inv_scale.numel() != 1:
            return False
        zp = int(m.x_zero_point) if m.x_zero_point is not None else 0
        keys.add((m.weight.dtype, float(m.x_scale), zp))
    dtype = producer.weight.dtype
    if len(keys) != 1 or next(iter(keys))[0] != dtype:
        return False
    if any(m.weight.dtype != dtype for _, m in residuals):
        return False
    first = inputs[0][1]
    producer.out_dtype = dtype
    producer._set_qparams("out", first.x_scale, first.x_zero_point)
    for _, mod in inputs:
        mod._input_quantized = True
    for _, mod in residuals:
        mod.residual_scale = first.x_scale.clone()
        mod.residual_zero_point = (first.x_zero_point.clone()
                                   if first.x_zero_point is not None else None)
    readers = [u.target for u, _ in inputs] + [f"{u.target} (residual)" for u, _ in residuals]
    changed[node.args[0].target] = (node.name, readers)
    return True
