"""``qfuse.export_torchscript``: a converted model as a TorchScript file (``torch.jit.trace``).

TorchScript is deprecated upstream in favour of ``torch.export`` (``qfuse.export_program``), but
C++ (libtorch) and older serving stacks still load it, so qfuse ships it. Tracing, not scripting:
the converted model is an fx ``GraphModule`` of aten ops whose generated code (pytree input
handling, export guards) ``torch.jit.script`` does not compile, while a trace records each fused
layer as one ``qfuse::qlinear``/``qfuse::qconv2d`` call. The loading process must
``import qfuse`` first: that registers those ops with the dispatcher.

A trace records the shapes the model computed in Python at trace time, so the file may be
specialised to the example's shapes (MiniLM's batch size is); export with the shapes you serve,
or use ``export_program`` for dynamic shapes. The trace also bakes in the device.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings

import torch
from torch import fx, nn

from qfuse.errors import CaptureError
from qfuse.export.checks import converted_state, normalize_inputs, same_outputs
from qfuse.fileio import atomic_path


def export_torchscript(
    qmodel: fx.GraphModule,
    example_inputs: tuple,
    path: str | os.PathLike,
    *,
    example_kwargs: dict | None = None,
) -> torch.jit.ScriptModule:
    """Trace ``qmodel`` on the example inputs and write it to ``path`` atomically.

    The trace is run on the examples before writing and must give outputs identical to
    ``qmodel``'s (``torch.equal``), else ``CaptureError``. Outputs that are dataclasses (Hugging
    Face ``ModelOutput``) come back as plain dicts. Returns the traced module.

    Example:
        >>> import os, tempfile, torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> path = os.path.join(tempfile.mkdtemp(), "model.ts")
        >>> traced = qfuse.export_torchscript(qmodel, (x,), path)
        >>> torch.equal(torch.jit.load(path)(x), qmodel(x))
        True
    """
    converted_state(qmodel, "qfuse.export_torchscript")
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    if kwargs and args:  # trace takes positional or keyword examples, not both
        args, kwargs = _positional(qmodel, args, kwargs), {}
    with torch.no_grad():
        expected = qmodel(*args, **kwargs)
        with _unshared(qmodel):
            traced = _trace(qmodel, args, kwargs)
        actual = traced(*args, **kwargs)
    if not same_outputs(expected, actual):
        raise CaptureError(
            "the TorchScript trace does not reproduce the model's outputs on the example inputs "
            "(Python control flow on values was frozen at trace time). Use qfuse.export_program."
        )
    with atomic_path(path) as tmp:
        torch.jit.save(traced, tmp)
    return traced


@contextlib.contextmanager
def _unshared(model: nn.Module):
    """While tracing, give every module slot that holds a tensor already held elsewhere its own
    copy: TorchScript refuses a tensor registered twice ("parameter sharing between modules"),
    and a dynamic layer's ``scale`` is its ``weight_scale``. The model is restored afterwards;
    the trace keeps the copies."""
    seen, swapped = set(), []
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, tensor in slots.items():
                if tensor is None:
                    continue
                if id(tensor) in seen:
                    swapped.append((slots, name, tensor))
                    copy = tensor.detach().clone()
                    slots[name] = nn.Parameter(copy, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else copy
                seen.add(id(tensor))
    try:
        yield
    finally:
        for slots, name, tensor in swapped:
            slots[name] = tensor


def _trace(qmodel, args: tuple, kwargs: dict) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` on positional or keyword examples; ``CaptureError`` if it fails."""
    with warnings.catch_warnings():
        # Every converted model calls the export guard function ``_guards_fn``, whose
        # torch._assert on input sizes makes the tracer warn once per check. Those warnings are
        # raised from torch/__init__.py, so a TracerWarning from user code still shows; the
        # equality check in export_torchscript is what guards the trace.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module="torch")
        try:
            if kwargs:
                return torch.jit.trace(
                    qmodel, example_kwarg_inputs=kwargs, strict=False, check_trace=False
                )
            return torch.jit.trace(qmodel, args, strict=False, check_trace=False)
        except Exception as exc:  # the tracer raises RuntimeError/TypeError/ValueError alike
            raise CaptureError(
                f"torch.jit.trace failed on {type(qmodel).__name__}: {str(exc).splitlines()[0]}. "
                "Use qfuse.export_program (torch.export) instead."
            ) from exc


def _positional(qmodel, args: tuple, kwargs: dict) -> tuple:
    """``args`` + ``kwargs`` as one positional tuple in ``forward``'s parameter order."""
    bound = inspect.signature(qmodel.forward).bind(*args, **kwargs)
    if bound.kwargs:
        raise CaptureError(
            f"cannot trace with keyword-only inputs {sorted(bound.kwargs)} next to positional "
            "ones; pass every input by keyword (example_kwargs) or positionally."
        )
    return bound.args
