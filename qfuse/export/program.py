"""``qfuse.export_program``: a converted model as a ``torch.export`` program (``.pt2``).

The modern path: ``torch.export.load`` restores it in any process that has run ``import qfuse``
(which registers the ``qfuse::`` ops the program calls), with symbolic shapes, so one file serves
every batch size. The same program is what AOTInductor and ExecuTorch start from.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import fx

from qfuse.errors import CaptureError
from qfuse.export.checks import converted_state, normalize_inputs
from qfuse.fileio import atomic_path
from qfuse.pipeline.capture import default_dynamic_shapes


def export_program(
    qmodel: fx.GraphModule,
    example_inputs: tuple,
    path: str | os.PathLike,
    dynamic_shapes=None,
    *,
    example_kwargs: dict | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export`` ``qmodel`` and save the program to ``path`` (``.pt2``) atomically.

    ``dynamic_shapes`` defaults to a dynamic dim 0 (batch) on every tensor input, as in
    ``qfuse.prepare``; pass ``torch.export`` dynamic shapes to choose others. An example batch of 1
    makes export specialise the batch (a warning says so): use at least 2. Returns the program.
    A program whose inputs or outputs are custom classes (a Hugging Face ``ModelOutput``) needs
    the module defining them imported before ``torch.export.load``.

    Example:
        >>> import os, tempfile, torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt2")
        >>> _ = qfuse.export_program(qmodel, (x,), path)
        >>> program = torch.export.load(path)
        >>> x7 = torch.randn(7, 8)
        >>> torch.equal(program.module()(x7), qmodel(x7))
        True
    """
    converted_state(qmodel, "qfuse.export_program")
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    default = dynamic_shapes is None
    if default:
        dynamic_shapes = default_dynamic_shapes(qmodel, args, kwargs)
    try:
        program = torch.export.export(
            qmodel, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as exc:  # export raises many types; all mean "could not export"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export failed on the converted {type(qmodel).__name__}: {first}. Check "
            "dynamic_shapes against the example inputs (a dim the model fixes cannot be dynamic)."
        ) from exc
    if default and (static := static_batch_inputs(program)):
        warnings.warn(
            f"qfuse.export_program: the batch dimension of {', '.join(static)} was specialised to "
            "the example's size, so the program runs at that batch size only. Export with an "
            "example batch of at least 2, or pass dynamic_shapes.",
            stacklevel=2,
        )
    with atomic_path(path) as tmp:
        torch.export.save(program, tmp)
    return program


def static_batch_inputs(program: torch.export.ExportedProgram) -> list[str]:
    """The user inputs of ``program`` whose dim 0 is a fixed number, not a symbol."""
    user_inputs = set(program.graph_signature.user_inputs)
    static = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if (
            isinstance(val, torch.Tensor)
            and val.dim() >= 1
            and not isinstance(val.shape[0], torch.SymInt)
        ):
            static.append(node.name)
    return static
