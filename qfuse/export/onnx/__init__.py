"""``qfuse.export_onnx``: a converted model as an ONNX QDQ graph for onnxruntime and TensorRT.

Route: the converted ``fx.GraphModule`` is copied, its fused layers rewritten as the QDQ pattern
(``graph``, ``layers``) with qfuse's own scales, zero points and int8 weights, and the copy is
exported with ``torch.onnx.export(dynamo=True)``; the four ops the rewrite adds translate to
single ONNX nodes (``ops.translations``). Every other op (embeddings, attention, norms,
reshapes) goes through torch's own ONNX translation, as far as that covers the model's ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import warnings

import torch
from torch.utils import _pytree as pytree

from qfuse.errors import CaptureError, UnsupportedError
from qfuse.export.checks import converted_state, normalize_inputs
from qfuse.fileio import atomic_path

ACTIVATION_DTYPES = {"int8": torch.int8, "uint8": torch.uint8}
MIN_OPSET = 19  # QuantizeLinear / DequantizeLinear with float8e4m3fn (and int8 per-axis)


@dataclasses.dataclass
class OnnxExport:
    """What ``export_onnx`` wrote: the file, the opset, each fused layer's ONNX form (layer
    name -> description) and what was written as a nearest equivalent (``notes``; also in the
    file's ``metadata_props["qfuse.notes"]``)."""

    path: str
    opset: int
    layers: dict[str, str]
    notes: list[str]


def _describe(mod) -> str:
    from qfuse.export.onnx.layers import QDQLinear

    op = "MatMul" if isinstance(mod, QDQLinear) else "Conv"
    dtype = "fp8_e4m3" if mod.qdtype == torch.float8_e4m3fn else "int8"
    if getattr(mod, "dynamic", False):
        return f"{dtype} per-token quantize -> MatMulInteger"
    src = "quantized input" if mod.input_quantized else "Q -> DQ"
    sink = "Q (quantized hand-off)" if mod.out is not None else "float"
    return f"{dtype} {src} -> {op}(DQ weight) -> {sink}"


def batch_and_sequence(model, args: tuple, kwargs: dict) -> dict:
    """Dynamic shapes for the ONNX inputs: axis 0 (batch) of every tensor, and axis 1
    (sequence) of token-like inputs (2-D integer or boolean: ids, masks) and of 3-D tensors
    ([batch, sequence, features]); every other axis keeps the example's size."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    auto = torch.export.Dim.AUTO

    def spec(value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        tokens = value.dim() == 2 and not value.is_floating_point()
        return {0: auto, 1: auto} if tokens or value.dim() == 3 else {0: auto}

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


@contextlib.contextmanager
def _quiet_registration():
    """torch.onnx's exporter logs a warning per torchvision op it cannot register when
    torchvision is not installed ("torchvision is not installed. Skipping torchvision::nms",
    four per export): nothing to do with the model exported."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def export_onnx(
    qmodel,
    path: str | os.PathLike,
    example_inputs=(),
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    activations: str = "int8",
    opset: int = MIN_OPSET,
) -> OnnxExport:
    """Write converted ``qmodel`` to ``path`` as ONNX QuantizeLinear / DequantizeLinear (QDQ).

    Weights are int8 (or fp8 e4m3) initializers read by a per-channel DequantizeLinear; static
    activations get a QuantizeLinear -> DequantizeLinear pair with qfuse's scale and zero point,
    and an int8 hand-off between fused layers is the producer's QuantizeLinear read by the
    consumer's DequantizeLinear. ``activations="uint8"`` writes every quantized activation as
    uint8 with the zero point moved up by 128 (the same real values; onnxruntime's preferred
    activation type on some CPUs). ``dynamic_shapes`` defaults to ``batch_and_sequence``: named
    ``batch`` and ``sequence`` in the file. ``opset`` is at least 19. The file is
    written to a temporary name, checked with ``onnx.checker`` and renamed: a failed export
    leaves nothing at ``path``. Raises ``UnsupportedError`` naming a layer with no ONNX form
    (fp8 with dynamic per-token scales), ``CaptureError`` when ``torch.onnx.export`` fails.
    Run it in onnxruntime with ``session_options()`` (its precise int8 mode; on CPUs without
    AVX-VNNI the default mode saturates).

    Example:
        >>> import os, tempfile, torch, qfuse
        >>> import onnxruntime as ort
        >>> from qfuse.export.onnx import session_options
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> path = os.path.join(tempfile.mkdtemp(), "model.onnx")
        >>> result = qfuse.export_onnx(qmodel, path, (x,))
        >>> sess = ort.InferenceSession(path, session_options(), providers=["CPUExecutionProvider"])
        >>> x7 = torch.randn(7, 8)
        >>> y = sess.run(None, {sess.get_inputs()[0].name: x7.numpy()})[0]
        >>> bool((torch.from_numpy(y) - qmodel(x7)).abs().max() < 1e-3)
        True
    """
    from qfuse.export.onnx.graph import rewrite

    converted_state(qmodel, "qfuse.export_onnx")
    if activations not in ACTIVATION_DTYPES:
        raise UnsupportedError(f"export_onnx activations={activations!r}: use 'int8' (qfuse's "
                               "own values) or 'uint8' (the same values shifted by 128).")
    if opset < MIN_OPSET:
        raise UnsupportedError(f"export_onnx opset={opset}: QDQ export needs opset >= "
                               f"{MIN_OPSET} (float8 QuantizeLinear); pass opset={MIN_OPSET}.")
    try:
        import onnx

        from qfuse.export.onnx.ops import translations

        table = translations()
    except ImportError as exc:
        raise UnsupportedError(f"qfuse.export_onnx needs onnx and onnxscript ({exc.name} is "
                               "missing): pip install onnx onnxscript onnxruntime") from exc
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    graph, layers, notes = rewrite(qmodel, ACTIVATION_DTYPES[activations])
    if dynamic_shapes is None:
        dynamic_shapes = batch_and_sequence(qmodel, args, kwargs)
    try:
        with warnings.catch_warnings(), torch.no_grad(), _quiet_registration():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                graph, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, dynamo=True,
                custom_translation_table=table, opset_version=opset, verbose=False,
                report=False, optimize=True)
    except Exception as exc:  # the exporter raises many types; all mean "could not export"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"torch.onnx.export failed on the converted "
                           f"{type(qmodel).__name__}: {first}") from exc
    described = {name: _describe(mod) for name, mod in layers}
    program.model.metadata_props["qfuse.notes"] = json.dumps(notes)
    program.model.metadata_props["qfuse.layers"] = json.dumps(described)
    from qfuse.export.onnx.proto import (
        dedicate_dequantize,
        name_dynamic_dims,
        name_outputs,
        output_names,
        unshare_qparams,
    )

    model = program.model_proto
    dedicate_dequantize(model)
    unshare_qparams(model)
    name_dynamic_dims(model)
    spec = getattr(qmodel, "_out_spec", None)
    if spec is not None:  # the exporter names them after graph nodes (layer_norm_12, tanh)
        name_outputs(model, output_names(spec))
    with atomic_path(path) as tmp:
        onnx.save(model, tmp)
        try:
            onnx.checker.check_model(tmp, full_check=True)
        except onnx.checker.ValidationError as exc:
            raise CaptureError(f"export_onnx wrote a graph onnx.checker rejects: {exc}") from exc
    return OnnxExport(os.fspath(path), opset, described, notes)


from qfuse.export.onnx.proto import optimized_ops, session_options  # noqa: E402

__all__ = ["OnnxExport", "export_onnx", "optimized_ops", "session_options"]
