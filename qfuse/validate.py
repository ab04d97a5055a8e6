"""Checks of what users hand ``qfuse.prepare``: the model's mode, layer-config globs, and a model
in which nothing can be quantized. Each failure names the problem and the fix."""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.errors import ModeError, ShapeError, UnsupportedError
from qfuse.fusion.patterns import Chain, Skipped

# Modules that compute something else in train mode: BatchNorm normalises with batch statistics
# (and prepare folds running statistics still being trained), Dropout drops.
aten = torch.ops.aten
_TRAIN_SENSITIVE = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


def check_eval_mode(model: nn.Module) -> None:
    """Refuse a model in train mode whose BatchNorm or Dropout would change the numerics.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))  # train mode, as built
        >>> check_eval_mode(model)
        Traceback (most recent call last):
        ...
        qfuse.errors.UnsupportedError: Sequential is in train mode ...
        >>> check_eval_mode(model.eval())
    """
    if not model.training:
        return
    sensitive = [
        f"{name or type(model).__name__} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, _TRAIN_SENSITIVE) and m.training and getattr(m, "p", 1) != 0
    ]
    if sensitive:
        shown = ", ".join(sensitive[:3]) + (
            f" and {len(sensitive) - 3} more" if len(sensitive) > 3 else ""
        )
        raise UnsupportedError(
            f"{type(model).__name__} is in train mode and {shown} compute differently there: "
            "post-training quantization calibrates the model as it will serve. Call "
            "model.eval() before qfuse.prepare, or use qfuse.prepare_qat to keep training with "
            "fake quantization."
        )


def _literal(pattern: str) -> str:
    return re.sub(r"[*?\[\]]", "", pattern)


def check_layer_globs(layer_configs: Mapping | None, chains: list[Chain], option: str) -> None:
    """Every glob of ``layer_configs`` must match a quantizable layer: a typo fails, listing the
    closest layer names, instead of being silently ignored.

    Example:
        >>> from qfuse.fusion.patterns import Chain
        >>> chains = [Chain("encoder.0.fc", "linear", "a", "x", "encoder.0.fc.weight", None)]
        >>> check_layer_globs({"encoder.*.fc": None}, chains, "layer_configs")
        >>> check_layer_globs({"encodr.*.fc": None}, chains, "layer_configs")
        Traceback (most recent call last):
        ...
        qfuse.errors.UnsupportedError: layer_configs glob 'encodr.*.fc' matches no ...
    """
    names = [c.name for c in chains]
    for pattern in layer_configs or {}:
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        close = difflib.get_close_matches(_literal(pattern), names, n=5, cutoff=0.3)
        close = close or names[:5]
        raise UnsupportedError(
            f"{option} glob {pattern!r} matches no quantizable layer. Closest layer names: "
            f"{close}. Globs match whole names (fnmatch: '*' spans dots); qfuse.summary("
            "prepared) lists every layer."
        )


def explain_nothing_quantized(model_name: str, chains: list[Chain], skipped: list[Skipped]) -> list:
    """When no layer can be quantized: warn with the reasons, and return a ``Skipped`` row for the
    summary if there is not even a GEMM to list."""
    if chains:
        return []
    if skipped:
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:5])
        extra = []
    else:
        reasons = (
            "the captured graph has no Linear, Conv2d, Conv1d or matmul with a parameter weight"
        )
        extra = [Skipped(model_name, "model", reasons)]
    warnings.warn(
        f"qfuse.prepare: nothing in {model_name} can be quantized ({reasons}); the converted "
        "model will run entirely in float. qfuse.summary lists each layer and why.",
        stacklevel=3,
    )
    return extra


class ModelRef:
    """The user's model, held by a prepared model's state and shared (never copied) when the
    prepared or converted graph is deep-copied: ``convert(output="model")`` swaps into it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __deepcopy__(self, memo):
        return self

    def names(self) -> Iterable[str]:
        return (name for name, _ in self.model.named_modules())


def check_not_quantized(model: nn.Module) -> None:
    """``prepare`` takes the float model: refuse one that ``prepare``/``convert`` already made.

    Example:
        >>> import torch, qfuse
        >>> model, x = torch.nn.Linear(4, 4).eval(), torch.randn(2, 4)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
        >>> check_not_quantized(prepared)
        Traceback (most recent call last):
        ...
        qfuse.errors.ModeError: this model is already prepared ...
    """
    from qfuse.state import get_state

    state = get_state(model)
    if state is None:
        return
    stage = {"qat": "prepared for QAT"}.get(state.stage, state.stage)
    fix = {
        "prepared": "calibrate it (call it on a few batches) and pass it to qfuse.convert",
        "prepared for QAT": "train it, then pass it to qfuse.convert",
    }.get(stage, "it runs as it is; to quantize again, pass qfuse.prepare the float model")
    raise ModeError(f"this model is already {stage} by qfuse: {fix}.")


def check_example_tensors(example_inputs, example_kwargs) -> None:
    """The example inputs must be real tensors a float model can take: not on the ``meta``
    device, not an empty batch, not complex."""
    leaves = pytree.tree_leaves((example_inputs, example_kwargs or {}))
    for i, t in enumerate(x for x in leaves if isinstance(x, torch.Tensor)):
        where = f"example tensor {i} (shape {tuple(t.shape)}, {t.dtype}, {t.device.type})"
        if t.device.type == "meta":
            raise ShapeError(f"qfuse.prepare: {where} holds no data; calibration runs the model, "
                             "so pass real example tensors on the device the model is on.")
        if t.dim() >= 1 and t.shape[0] == 0:
            raise ShapeError(f"qfuse.prepare: {where} is an empty batch; pass at least one "
                             "sample (two or more keep the batch size free).")
        if t.is_complex():
            raise UnsupportedError(f"qfuse.prepare: {where} is complex; qfuse quantizes real "
                                   "float models.")


def check_gemm_input_dtypes(gm: fx.GraphModule) -> None:
    """An integer input that a Linear/Conv reads directly (an int64 batch for a float model):
    the float model fails on it too, so say which input and how to fix it instead of keeping
    the layer float and failing at calibration."""
    gemms = {aten.linear.default, aten.conv2d.default, aten.conv1d.default, aten.addmm.default,
             aten.mm.default, aten.matmul.default, aten.convolution.default}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        if val.is_floating_point():
            continue
        reader = next((u for u in node.users if u.target in gemms), None)
        if reader is not None:
            raise UnsupportedError(
                f"qfuse.prepare: input {node.target!r} is {val.dtype} and goes straight into "
                f"{reader.target.__name__.split('.')[0]} ({reader.name}), which takes float: "
                "pass the example (and every later batch) as float, e.g. x.float()."
            )


def warn_pinned_batch(gm: fx.GraphModule, dynamic_shapes) -> None:
    """With the default dynamic shapes, export pins a dimension of size 1 in the example (its
    0/1 specialisation): a batch-1 example gives a model that takes batch 1 only. Say so."""
    if dynamic_shapes is not None:
        return
    pinned = [
        n.target for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor)
        and v.dim() >= 2 and isinstance(v.shape[0], int) and v.shape[0] == 1
    ]
    if pinned:
        warnings.warn(
            f"qfuse.prepare: the example batch of {', '.join(map(repr, pinned))} has size 1, so "
            "the captured model takes batch 1 only (torch.export pins size-1 dimensions). Pass "
            "an example batch of 2 or more to serve any batch size.",
            stacklevel=4,
        )


# Float layers with weights that no chain covers, and why qfuse leaves them (summary lists them).
_UNSUPPORTED = (
    (nn.RNNBase, "a recurrent layer: qfuse quantizes Linear and Conv layers"),
    (nn.modules.conv._ConvTransposeNd, "transposed convolutions are not quantized"),
    (nn.Conv3d, "3-D convolutions are not quantized"),
    (nn.Bilinear, "bilinear layers are not quantized"),
)


def unlisted_float_layers(model: nn.Module, chains: list[Chain], skipped: list[Skipped]) -> list:
    """A ``Skipped`` row for each layer of ``model`` that qfuse cannot quantize and that no chain
    or skipped row names (an ``nn.LSTM`` ran in float without a word in the summary)."""
    listed = [c.name for c in chains] + [s.name for s in skipped]
    rows = []
    for name, module in model.named_modules():
        reason = next((r for cls, r in _UNSUPPORTED if isinstance(module, cls)), None)
        if reason is None or any(n == name or n.startswith(f"{name}.") for n in listed):
            continue
        rows.append(Skipped(name or type(model).__name__, type(module).__name__,
                            f"{reason}; it runs in float"))
    return rows
