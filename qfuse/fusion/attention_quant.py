"""Attention + quantize: an encoder's SDPA read by a static quantized Linear hands it int8/fp8.

In a converted BERT / MiniLM, ``aten.scaled_dot_product_attention`` writes [B, H, S, D] in the
model's float dtype, the graph moves it to [B, S, H*D] (``transpose(1, 2)`` and a reshape: a copy)
and the attention-output Linear quantizes it with its static input scale in a separate pass.
``fuse_attention_quant`` replaces that whole run with ``qfuse::attention_quant``, which writes the
quantized [B, S, H*D] tensor from the attention's registers; the Linear then reads it as is
(``input_quantized``), as after ``fusion.norm_quant``. On CUDA the op runs the Triton kernel; on
the CPU its reference (SDPA in float32, the cast, the reference quantizer), so a CPU model
computes what the unfused graph does up to SDPA's own float rounding.

Matched: no dropout, not causal, no GQA, a 4-D q of head dim at most 256 in float32 / bf16 /
fp16, any ``scale``, a boolean or float mask or none; q, k and v straight from the projections
through view and split ops (encoder self-attention: a decoder's rotary embedding or KV cache
keeps SDPA, whose causal and decode kernels suit it); between SDPA and the reader only view ops
(view, reshape, transpose, permute, contiguous) that each have one reader and together give the
[B, S, H*D] row layout; the reader a ``QLinear`` with a static per-tensor input scale that reads
it as its input only. Any other SDPA is left as it is. Runs after ``eager_rewrites`` (so a
boolean mask already goes through ``drop_full_mask``), for ``convert`` and for ``load`` alike.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from qfuse.fusion.graph_utils import erase_if_dead
from qfuse.fusion.norm_quant import _static_reader
from qfuse.ops.attention import attention_quant_call

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# view ops between SDPA and the reader, aten overloads and the tensor methods ``eager_rewrites``
# turns them into
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, "view",
             "reshape"}
_TRANSPOSES = {aten.transpose.int, "transpose"}
_PERMUTES = {aten.permute.default, "permute"}
_IDENTITIES = {aten.contiguous.default, "contiguous", aten.alias.default, aten.clone.default}
# what may sit between a projection and q, k or v: the views above and the QKV output's split
_SPLITS = {aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
           aten.unflatten.int, operator.getitem, "split", "unflatten"}
_VIEWS = _RESHAPES | _TRANSPOSES | _PERMUTES | _IDENTITIES | _SPLITS


def _val(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _projected(node) -> bool:
    """True when ``node`` is a layer's output seen through view and split ops only: q, k, v of
    encoder self-attention. Decoders' attention reads rotary-embedded q/k (arithmetic) or a KV
    cache, and is left to SDPA's causal and decode kernels."""
    for _ in range(12):
        if not isinstance(node, fx.Node):
            return False
        if node.op == "call_module" or node.target is aten.linear.default:
            return True
        if node.op not in ("call_function", "call_method") or node.target not in _VIEWS:
            return False
        node = node.args[0] if node.args else None
    return False


def _sdpa_inputs(node: fx.Node):
    """``(q, k, v, mask, scale)`` of an SDPA call the kernel computes, else None."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, (None, None, None, None, 0.0, False), strict=True))
    args.update(zip(names, node.args, strict=False))
    args.update({k: v for k, v in node.kwargs.items() if k in names})
    if args["dropout_p"] != 0.0 or args["is_causal"] is not False or node.kwargs.get(
        "enable_gqa", False
    ):
        return None
    if not all(_projected(args[n]) for n in names[:3]):
        return None
    q, k, v, mask = (_val(args[n]) for n in names[:4])
    if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    D = q.shape[3]
    if not isinstance(D, int) or D > 256 or k.shape[3] != D or v.shape[3] != D or (
        k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]
    ):
        return None
    if args["attn_mask"] is not None and (mask is None or not (
        mask.dtype == torch.bool or mask.is_floating_point()
    )):
        return None
    scale = node.kwargs.get("scale")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return args["query"], args["key"], args["value"], args["attn_mask"], scale


def _size(axes, sizes):
    out = 1
    for a in axes:
        out = out * sizes[a]
    return out


def _reshape(dims, sizes, target):
    """The dims (tuples of SDPA output axes) after reshaping to ``target``, or None when it is
    not a regrouping of whole dims (a split, or sizes that cannot be compared)."""
    out, i = [], 0
    for t in target:
        if i < len(dims) and str(_size(dims[i], sizes)) == str(t):
            out.append(dims[i])
            i += 1
            continue
        group, prod = (), 1  # merge whole dims of known size (H, D) until the product is t
        while i < len(dims) and str(prod) != str(t):
            size = _size(dims[i], sizes)
            if not isinstance(size, int):
                return None
            group, prod, i = group + dims[i], prod * size, i + 1
        if str(prod) != str(t) or not group:
            return None
        out.append(group)
    return out if i == len(dims) else None


def _rows_layout(sdpa: fx.Node):
    """``(nodes, end)``: the view ops from ``sdpa`` (each with one reader) to ``end``, whose
    value is the attention as [B, S, H*D] rows; None if the chain does not get there."""
    val = _val(sdpa)
    if val is None or val.dim() != 4:
        return None
    sizes = dict(zip("bhsd", val.shape, strict=True))
    dims = [("b",), ("h",), ("s",), ("d",)]
    node, chain = sdpa, []
    while dims != [("b",), ("s",), ("h", "d")]:
        if len(node.users) != 1:
            return None
        nxt = next(iter(node.users))
        if nxt.op not in ("call_function", "call_method") or not nxt.args or (
            nxt.args[0] is not node
        ):
            return None
        target, out = nxt.target, _val(nxt)
        if out is None:
            return None
        if target in _TRANSPOSES:
            i, j = (a % len(dims) for a in nxt.args[1:3])
            dims = list(dims)
            dims[i], dims[j] = dims[j], dims[i]
        elif target in _PERMUTES:
            perm = nxt.args[1] if len(nxt.args) == 2 else nxt.args[1:]
            dims = [dims[p % len(dims)] for p in perm]
        elif target in _RESHAPES:
            dims = _reshape(dims, sizes, out.shape)
            if dims is None:
                return None
        elif target not in _IDENTITIES:
            return None
        if out.dim() != len(dims):
            return None
        chain.append(nxt)
        node = nxt
    return chain, node


def fuse_attention_quant(gm: fx.GraphModule) -> dict[str, str]:
    """Fuse every eligible attention; returns {reader layer path: "attention (node)"}.

    Example (a converted tiny BERT; its attention-output layers now read int8):
        >>> import torch, transformers, qfuse
        >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1,
        ...                               num_attention_heads=2, intermediate_size=64)
        >>> model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
        >>> ids = {"input_ids": torch.randint(0, 32, (2, 8))}
        >>> p = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=ids)
        >>> _ = p(**ids)
        >>> q = qfuse.convert(p)
        >>> sum(n.target is attention_quant_call for n in q.graph.nodes)
        1
    """
    fused: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        inputs = _sdpa_inputs(node)
        found = _rows_layout(node) if inputs is not None else None
        if found is None:
            continue
        chain, end = found
        if len(end.users) != 1:
            continue
        user = next(iter(end.users))
        mod = _static_reader(gm, user, end)
        if mod is None or end in user.kwargs.values() or user.args.count(end) != 1:
            continue
        q, k, v, mask, scale = inputs
        with gm.graph.inserting_before(user):
            inv = gm.graph.get_attr(f"{user.target}.x_inv_scale")
            zp = (gm.graph.get_attr(f"{user.target}.x_zero_point")
                  if mod.x_zero_point is not None else None)
            attn = gm.graph.call_function(
                attention_quant_call, (q, k, v, mask, scale, inv, zp, mod.weight.dtype)
            )
        user.update_arg(0, attn)
        mod._input_quantized = True
        fused[user.target] = f"attention ({node.name})"
        erase_if_dead(gm, [*reversed(chain), node])
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused
