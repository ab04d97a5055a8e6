"""Launching a compiled Triton kernel without ``JITFunction.run``.

``kernel[grid](...)`` binds and specializes every argument, hashes a cache key and checks globals
on every call: more host time per launch than the whole GEMM takes at decode sizes; launched this
way, one QLinear costs well under half the host time (``bench/host_overhead.py`` measures both).
A ``CachedLaunch`` keeps the
``CompiledKernel`` that a first, ordinary launch returned, plus the arguments that do not change
between calls (sizes fixed per layer, strides of contiguous tensors, constexprs), and calls its
launcher directly with the ones that do (pointers, M, the grid).

That is only valid while every argument specializes the same way as in the first launch: callers
keep the changing integers ``do_not_specialize`` and pass 16-byte aligned, contiguous tensors.
The launcher's calling convention is Triton's, not a public API; ``build`` checks
it once against an ordinary launch and returns the reason instead when it does not hold, so the
caller falls back to the plain launch and ``qfuse.summary`` can say so.
"""

from __future__ import annotations

import torch


class CachedLaunch:
    """One compiled specialization, launched as ``self(grid0, grid1, stream, *head)``: ``head``
    is the leading arguments that change per call; the rest were fixed at ``build``."""

    __slots__ = ("_run", "_function", "_metadata", "_tail")

    def __init__(self, compiled, args: dict, n_head: int) -> None:
        self._run = compiled.run  # property: loads the module and creates the launcher
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._tail = tuple(args.values())[n_head:]

    def __call__(self, grid0: int, grid1: int, stream: int, *head) -> None:
        # Triton >= 3.2 launcher convention: grid, stream, function, packed metadata, launch
        # metadata and the enter/exit hooks (none: no profiler hook wants qfuse's launches),
        # then every kernel argument in signature order, constexprs included.
        self._run(grid0, grid1, 1, stream, self._function, self._metadata, None, None, None,
                  *head, *self._tail)


def build(compiled, kernel, args: dict, n_head: int) -> CachedLaunch | str:
    """A ``CachedLaunch`` from what ``kernel[grid](**args)`` returned, or why there is none."""
    names = list(getattr(kernel, "arg_names", ()))
    if list(args) != names:
        return f"argument order differs from the kernel's signature ({len(args)} vs {len(names)})"
    try:
        return CachedLaunch(compiled, args, n_head)
    except Exception as exc:  # noqa: BLE001 — another Triton's CompiledKernel: fall back
        return f"plain launch (this Triton's compiled kernel has no {exc})"


def raw_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index)
