"""Checks of what users hand ``qfuse.prepare``: the model's mode, layer-config globs, and a model
in which nothing can be quantized. Each failure names the problem and the fix."""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Iterable, Mapping

from torch import nn

from qfuse.errors import UnsupportedError
from qfuse.fusion.patterns import Chain, Skipped

# Modules that compute something else in train mode: BatchNorm normalises with batch statistics
# (and prepare folds running statistics still being trained), Dropout drops.
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
