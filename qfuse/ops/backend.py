"""Which implementation runs a fused op, decided at call time.

``QFUSE_BACKEND=auto|triton|reference`` (environment) or ``qfuse.use_backend(...)`` (code):
- ``auto`` (default): Triton kernels for CUDA tensors, the PyTorch reference for CPU tensors.
- ``triton``: Triton everywhere. On CPU tensors that needs the Triton interpreter
  (``TRITON_INTERPRET=1`` set before qfuse is imported); without it this is a ``BackendError``.
- ``reference``: the PyTorch reference everywhere, CUDA included (numerics debugging).

The environment variable is read once per process (``read_environment`` reads it again).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

import torch

from qfuse.errors import BackendError
from qfuse.kernels.common import INTERPRETED


class Backend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"


_override: Backend | None = None

# Every eager call of a fused op asks for the backend (72 times per BERT-base forward), and
# ``os.environ.get`` costs up to 30 dict lookups there (timeit; an unset variable raises and
# catches a KeyError inside it): so QFUSE_BACKEND is read once per process, on the first call,
# and ``read_environment`` reads it again. In code, ``use_backend`` switches.
_from_environment: Backend | None = None


def read_environment() -> Backend:
    """The backend ``QFUSE_BACKEND`` asks for, read from the environment now and kept for the
    calls after this one."""
    global _from_environment
    value = os.environ.get("QFUSE_BACKEND", "auto").strip().lower()
    try:
        _from_environment = Backend(value)
    except ValueError:
        raise BackendError(
            f"QFUSE_BACKEND={value!r} is not a backend; use one of auto, triton, reference."
        ) from None
    return _from_environment


def requested_backend() -> Backend:
    if _override is not None:
        return _override
    return _from_environment if _from_environment is not None else read_environment()


@contextlib.contextmanager
def use_backend(backend: Backend | str) -> Iterator[None]:
    """Force a backend inside a ``with`` block.

    Example:
        >>> import qfuse
        >>> with qfuse.use_backend("reference"):
        ...     qfuse.resolve_backend(torch.device("cpu")).value
        'reference'
    """
    global _override
    previous, _override = _override, Backend(backend)
    try:
        yield
    finally:
        _override = previous


def triton_interpreted() -> bool:
    return INTERPRETED


def eager(x: torch.Tensor) -> bool:
    """True when no tracer, compiler or tensor subclass needs to see an op called on ``x``: the
    ``*_call`` functions then run its body (or a cached launch) without the dispatcher."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def kernel_wrap(device: torch.device):
    """How an op's body launches its Triton kernels on ``device``: through
    ``torch.library.wrap_triton`` on CUDA (so ``torch.compile`` sees the kernels), directly in
    the interpreter (None)."""
    return torch.library.wrap_triton if device.type == "cuda" and not INTERPRETED else None


def resolve_backend(device: torch.device, *, has_triton_kernel: bool = True) -> Backend:
    """The backend that runs an op on ``device`` now: ``TRITON`` or ``REFERENCE``."""
    requested = requested_backend()
    on_cuda = device.type == "cuda"
    if requested is Backend.REFERENCE:
        return Backend.REFERENCE
    if requested is Backend.AUTO:
        return Backend.TRITON if on_cuda and has_triton_kernel else Backend.REFERENCE
    if not has_triton_kernel:
        raise BackendError(
            "QFUSE_BACKEND=triton, but this op has no Triton kernel yet (reference only); "
            "use QFUSE_BACKEND=auto or reference for it."
        )
    if not on_cuda and not triton_interpreted():
        raise BackendError(
            f"QFUSE_BACKEND=triton on a {device.type} tensor needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing qfuse, or move the model to CUDA."
        )
    return Backend.TRITON
