"""The written ONNX file: the finishing pass over the protobuf, and onnxruntime helpers."""

from __future__ import annotations

import collections

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# What onnxruntime's CPU graph optimizer turns the QDQ pattern into (int8 kernels).
ORT_INT8_OPS = ("MatMulIntegerToFloat", "QLinearMatMul", "QGemm", "QLinearConv", "MatMulInteger",
                "QLinearAdd", "DynamicQuantizeMatMul")


def dedicate_dequantize(model) -> int:
    """One DequantizeLinear per consumer (what onnxruntime's tool writes with
    ``DedicatedQDQPair``); returns how many were added.

    The exporter merges equal nodes, so two layers reading one tensor (a ResNet block's conv and
    its projection shortcut) share one DequantizeLinear. onnxruntime fuses a DequantizeLinear
    into a layer's int8 kernel only when that layer is its sole reader; with a float-output
    layer beside it, neither fuses.
    """
    consumers: dict[str, list] = collections.defaultdict(list)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            consumers[name].append((node, i))
    added, nodes = 0, []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type != "DequantizeLinear":
            continue
        readers = consumers[node.output[0]]
        for k, (reader, i) in enumerate(readers[1:], start=1):
            copy = type(node)()
            copy.CopyFrom(node)
            copy.name = f"{node.name}__{k}"
            copy.output[0] = f"{node.output[0]}__{k}"
            reader.input[i] = copy.output[0]
            nodes.append(copy)
            added += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return added


def unshare_qparams(model) -> int:
    """Give every Q/DQ node its own scale and zero-point initializers; returns how many copies.

    The exporter merges equal constants (two layers with 16 output channels share one all-zero
    weight zero point). onnxruntime's int8-to-uint8 weight rewrite
    (``session.x64quantprecision``) then writes the converted tensor twice under one name and
    fails to load; its own quantization tool never shares them.
    """
    inits = {t.name: t for t in model.graph.initializer}
    uses = collections.Counter(
        name for n in model.graph.node if n.op_type in QDQ_OPS for name in n.input[1:])
    copies = 0
    for node in model.graph.node:
        if node.op_type not in QDQ_OPS:
            continue
        for i in range(1, len(node.input)):
            name = node.input[i]
            if uses[name] > 1 and name in inits:
                uses[name] -= 1
                copy = type(inits[name])()
                copy.CopyFrom(inits[name])
                copy.name = f"{name}__{node.name or copies}"
                model.graph.initializer.append(copy)
                node.input[i] = copy.name
                copies += 1
    return copies


def session_options(precise: bool = True, threads: int | None = None):
    """onnxruntime ``SessionOptions`` for a QDQ export on CPU.

    ``precise`` sets ``session.x64quantprecision``: on x86 CPUs without AVX-VNNI, onnxruntime's
    int8 GEMMs multiply uint8 x int8 pairs into saturating int16 (``vpmaddubsw``), which with
    full-range 8-bit weights and activations (qfuse's) is off by up to hundreds of steps;
    the precise mode runs the uint8 x uint8 kernels instead (exact int32 sums, slower).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if precise:
        opts.add_session_config_entry("session.x64quantprecision", "1")
    if threads is not None:
        opts.intra_op_num_threads = threads
    return opts


def optimized_ops(path: str, precise: bool = True) -> collections.Counter:
    """Op types of the graph onnxruntime's CPU provider runs for the model at ``path`` (after
    all its graph optimizations): where the QDQ pattern became int8 kernels."""
    import os
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = session_options(precise)
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        graph = onnx.load(opts.optimized_model_filepath).graph
    return collections.Counter(n.op_type for n in graph.node)


def name_dynamic_dims(model) -> dict[str, str]:
    """Rename the exporter's symbolic dims (``s72``) on the graph inputs' first two axes to
    ``batch`` and ``sequence``, everywhere they appear; returns the mapping."""
    names: dict[str, str] = {}
    for value in model.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim[:2]):
            name = ("batch", "sequence")[axis]
            if dim.dim_param and names.setdefault(dim.dim_param, name) != name:
                return {}  # one symbol on both axes: leave the exporter's names
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
    return names


def output_names(spec) -> list[str]:
    """Names of the flat outputs of pytree ``spec`` (a converted graph's ``_out_spec``), as the
    model names them: a ``ModelOutput``'s or dict's keys (``last_hidden_state``), tuple
    positions as ``output_0``..., nested names joined with ``.``, a lone tensor ``output``.

    Example:
        >>> from torch.utils import _pytree as pytree
        >>> output_names(pytree.tree_flatten({"logits": 0, "hidden": (1, 2)})[1])
        ['logits', 'hidden.0', 'hidden.1']
    """
    def walk(node, prefix: str):
        if node.is_leaf():
            yield prefix or "output"
            return
        context = node.context
        if isinstance(context, type) and hasattr(context, "_fields"):  # a namedtuple
            context = context._fields
        keys = list(context) if isinstance(context, (list, tuple)) else None
        for i, child in enumerate(node.children()):
            key = str(keys[i]) if keys is not None and i < len(keys) else str(i)
            if not prefix and keys is None:
                key = f"output_{i}"
            yield from walk(child, f"{prefix}.{key}" if prefix else key)

    return list(walk(spec, ""))


def name_outputs(model, names: list[str]) -> dict[str, str]:
    """Rename the graph outputs of ONNX ``model`` to ``names`` (in order), everywhere they are
    read or written; returns the mapping. Left as they are when the counts differ or a name is
    taken by another value."""
    outputs = model.graph.output
    if len(names) != len(outputs) or len(set(names)) != len(names):
        return {}
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    taken |= {t.name for t in model.graph.initializer}
    olds = [o.name for o in outputs]
    if len(set(olds)) != len(olds) or any(n in taken - set(olds) for n in names):
        return {}
    mapping = dict(zip(olds, names, strict=True))
    for node in model.graph.node:
        for seq in (node.input, node.output):
            for i, name in enumerate(seq):
                if name in mapping:
                    seq[i] = mapping[name]
    for value in (*outputs, *model.graph.value_info):
        value.name = mapping.get(value.name, value.name)
    return mapping
