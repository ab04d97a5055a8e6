"""NaN and ±Inf through a converted model: the quantized layers' inputs are marked, the float
outputs poisoned.

Quantizing turns a non-finite float into a finite code (int8 has none; e4m3 saturates ±Inf), and
a chain that hands int8 to the next layer carries no float at all, so neither a kernel nor a
single module can keep NaN alive. Instead:

- ``guard_graph`` (``convert(output="graph")`` and ``load``): at every point where a float tensor
  is quantized a mark is taken (``ops.nonfinite``). A layer that writes float puts NaN into its
  own output rows (a Linear's tokens, a Conv's samples). Where the layer hands int8/fp8 to the
  next one (or a norm quantizes for its readers) the mark is carried to the graph's float
  outputs, which are NaN in the marked samples: an index of the first dimension when that is
  the outputs' batch dimension (same size symbol), else the whole output.
- ``guard_model`` (``convert(output="model")``): every swapped quantized layer reads float and
  writes float, so each one puts NaN into its own output rows (a Linear's tokens, a Conv's
  samples) through a forward hook.

The float model gives NaN or ±Inf there; the quantized model gives NaN (never a finite answer).
Per sample is wider than float when a sample's tokens or pixels never mix (an MLP over tokens):
every output row of that sample is NaN, not only the token's. Non-finite values that never reach
a quantized layer (an additive ``-inf`` attention mask) mark nothing.

Only quantization points whose input depends on a floating-point input of the model are marked
(``float_fed``): a model fed token ids (BERT, Llama, GPT-2) computes every float from its
weights and integer inputs, and gets no marks at all: a mark is an extra pass over a float
tensor and a masked write of the layer's output, a visible share of a forward's time that such
a model need not pay. Values that turn non-finite inside the network from finite inputs (a bf16
overflow) are saturated by the quantized layers, as in any int8 engine.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.nn.base import QuantizedModule
from qfuse.ops.attention import attention_quant_call
from qfuse.ops.layernorm import layer_norm_quant_call
from qfuse.ops.nonfinite import any_marks, merge_marks, nonfinite_rows, poison_rows


def _quantized_module(gm: fx.GraphModule, node: fx.Node) -> QuantizedModule | None:
    """The quantized layer ``node`` calls with a float input, or None."""
    if node.op != "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    quantized = [m for m in gm.get_submodule(node.target).modules()
                 if isinstance(m, QuantizedModule)]
    return quantized[0] if quantized and not quantized[0].input_quantized else None


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def float_fed(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose value depends on a floating-point graph input (a placeholder
    without a recorded value counts as one): where a non-finite input can reach."""
    fed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = _val(node)
            if val is None or val.is_floating_point():
                fed.add(node)
        elif any(a in fed for a in node.all_input_nodes):
            fed.add(node)
    return fed


def guard_graph(gm: fx.GraphModule) -> int:
    """Mark the quantized inputs and poison the float outputs of ``gm`` (in place); returns how
    many quantization points were marked (0: the graph is unchanged).

    A layer that reads float and writes float puts NaN into its own output rows (each row of a
    Linear, each sample of a Conv), so the float ops after it see NaN where the float model
    does; a dynamic layer after it then takes its scale from the finite samples only. Where the
    quantized data goes on (a layer handing int8 to the next, a norm quantizing for its
    readers), the mark is carried to the graph's float outputs instead.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    batch = {str(_val(n).shape[0]) for n in _float_outputs(output) if _val(n).dim() >= 1}
    batch = batch.pop() if len(batch) == 1 else None
    carried, marked = [], 0
    fed = float_fed(gm)
    for node in list(gm.graph.nodes):
        module = _quantized_module(gm, node)
        if module is None and not (node.op == "call_function" and node.target in (
                layer_norm_quant_call, attention_quant_call)):
            continue
        if node.args[0] not in fed:
            continue
        source, marked = node.args[0], marked + 1
        val = _val(source)
        if module is not None and not module.output_quantized:
            rows = 1 if _is_conv(module) else (val.dim() - 1 if val is not None else 0)
            with gm.graph.inserting_after(node):
                mark = gm.graph.call_function(nonfinite_rows, (source, rows))
            with gm.graph.inserting_after(mark):
                poisoned = gm.graph.call_function(poison_rows, (node, mark))
            poisoned.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(poisoned, delete_user_cb=lambda u, p=poisoned: u is not p)
            fed.add(poisoned)  # the layers after it now read it: still float-fed
            continue
        rows = val is not None and val.dim() >= 1 and str(val.shape[0]) == batch
        with gm.graph.inserting_after(source):
            carried.append(gm.graph.call_function(nonfinite_rows, (source, 1 if rows else 0)))
    if carried and _float_outputs(output):
        _poison_outputs(gm, output, _float_outputs(output), carried, batch)
    if marked:
        gm.graph.lint()
        gm.recompile()
    return marked


def _float_outputs(output: fx.Node) -> list[fx.Node]:
    outs = [n for n in pytree.tree_leaves(output.args[0]) if isinstance(n, fx.Node)]
    return [n for n in outs if (v := _val(n)) is not None and v.is_floating_point()]


def _is_conv(module: nn.Module) -> bool:
    from qfuse.nn import QConv2d

    return isinstance(module, QConv2d)


def _poison_outputs(gm, output, float_outs, marks, batch) -> None:
    per_sample = [m for m in marks if m.args[1] == 1]
    with gm.graph.inserting_before(output):
        sample_mark = gm.graph.call_function(merge_marks, tuple(marks)) if per_sample else None
        total = gm.graph.call_function(any_marks, tuple(marks))
        replaced = {}
        for node in float_outs:
            rows = sample_mark is not None and _val(node).dim() >= 1 and \
                str(_val(node).shape[0]) == batch
            poisoned = gm.graph.call_function(poison_rows, (node, sample_mark if rows else total))
            poisoned.meta["val"] = node.meta["val"]
            replaced[node] = poisoned
    output.args = fx.node.map_arg(output.args, lambda n: replaced.get(n, n))
    for node in (sample_mark, total):
        if node is not None and not node.users:
            gm.graph.erase_node(node)


def _poison_hook(module: nn.Module, args: tuple, output):
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() \
            or x.dtype == torch.float8_e4m3fn or not isinstance(output, torch.Tensor):
        return output
    # A Linear's output row is one token (every leading dimension); a Conv's is one sample: a
    # non-finite pixel reaches only its receptive field in float, and the whole sample once the
    # network pools it.
    row_dims = 1 if _is_conv(module) else x.dim() - 1
    return poison_rows(output, nonfinite_rows(x, min(row_dims, output.dim())))


def float_inputs_used(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` (a prepared or converted graph) computes anything from a floating-point
    input: a swapped model needs NaN hooks only then (``guard_model``)."""
    fed = float_fed(gm)
    return any(n in fed for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def guard_model(model: nn.Module) -> int:
    """Give each quantized layer of a swapped model (float in, float out) the NaN hook; returns
    how many got one. Layers reading int8/fp8 (nothing to mark) get none."""
    hooked = 0
    for module in model.modules():
        if isinstance(module, QuantizedModule) and not module.input_quantized \
                and _poison_hook not in module._forward_hooks.values():
            module.register_forward_hook(_poison_hook)
            hooked += 1
    return hooked


def strip_marks(gm: fx.GraphModule) -> int:
    """Remove ``guard_graph``'s marks from ``gm`` (in place): every poisoned output reads the
    layer's own output again, and the marks go. For exporters whose target has no such ops (an
    ONNX QDQ graph: there a non-finite input quantizes to a finite code, as in any int8 engine).
    Returns how many outputs were un-poisoned."""
    marks = (nonfinite_rows, any_marks, merge_marks)
    stripped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is poison_rows:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            stripped += 1
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in marks and not node.users:
            gm.graph.erase_node(node)
    if stripped:
        gm.graph.lint()
        gm.recompile()
    return stripped
