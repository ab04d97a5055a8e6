"""Make a train-mode captured graph follow ``model.train()`` / ``model.eval()`` again.

``torch.export`` bakes the mode into the graph: ``aten.dropout(x, p, True)`` and
``scaled_dot_product_attention(..., dropout_p=p)`` drop in eval mode too, and the exported module
refuses ``.train()`` / ``.eval()``. QAT trains in train mode and evaluates its fake-quant model in
eval mode, so those ops become modules that read ``self.training``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

aten = torch.ops.aten


class AttentionDropout(nn.Module):
    """``scaled_dot_product_attention`` whose ``dropout_p`` applies in train mode only."""

    def __init__(self, dropout_p: float, kwargs: dict) -> None:
        super().__init__()
        self.dropout_p, self.kwargs = dropout_p, dict(kwargs)

    def forward(self, q, k, v, attn_mask=None):
        p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask, p, **self.kwargs)


def _sdpa_dropout(node: fx.Node) -> float:
    if len(node.args) > 4:
        return float(node.args[4])
    return float(node.kwargs.get("dropout_p", 0.0))


def make_mode_aware(gm: fx.GraphModule) -> int:
    """Swap train-mode dropout ops for modules and re-enable ``train``/``eval``; returns how many
    ops were swapped."""
    swapped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.dropout.default, aten.dropout_.default):
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            if not train:
                continue
            module = nn.Dropout(float(node.args[1]))
            args = (node.args[0],)
        elif node.target == aten.scaled_dot_product_attention.default and _sdpa_dropout(node):
            extra = {k: v for k, v in node.kwargs.items() if k != "dropout_p"}
            if len(node.args) > 5:
                extra["is_causal"] = node.args[5]
            module = AttentionDropout(_sdpa_dropout(node), extra)
            args = tuple(node.args[:4])
        else:
            continue
        name = f"qfuse_qat_mode_{node.name}"
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        swapped += 1
    # ExportedProgram.module() installs instance methods that refuse train()/eval(); the graph
    # now follows the mode, so nn.Module's own methods apply again.
    for attr in ("train", "eval"):
        gm.__dict__.pop(attr, None)
    gm.recompile()
    return swapped
