"""Which implementation runs a fused op, decided at call time.

``QFUSE_BACKEND=auto|triton|reference`` (environment) or ``qfuse.use_backend(...)`` (code):
- ``auto`` (default): Triton kernels for CUDA tensors, the PyTorch reference for CPU tensors.
- ``triton``: Triton everywhere. On CPU tensors that needs the Triton interpreter
  (``TRITON_INTERPRET=1`` set before qfuse is imported); without it this is a ``BackendError``.
- ``reference``: the PyTorch reference everywhere, CUDA included (numerics debugging).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

import torch

from qfuse.errors import BackendError


class Backend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"


_override: Backend | None = None

# Every eager call of a fused op asks for the backend: ``os.environ.get`` costs ~1 us of
# host time (2-3 on the H200 machine's host), 72 times per BERT-base forward. CPython keeps
# the environment in ``os.environ._data`` (what ``os.environ[...] = ...`` updates): one dict
# lookup of the encoded key, parsed once per distinct value.
_ENV_DATA = getattr(os.environ, "_data", None)
try:
    _ENV_KEY = os.environ.encodekey("QFUSE_BACKEND")  # type: ignore[attr-defined]
except AttributeError:  # another Python: read it the ordinary way
    _ENV_DATA = None
_PARSED: dict = {}


def requested_backend() -> Backend:
    if _override is not None:
        return _override
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get("QFUSE_BACKEND")
    backend = _PARSED.get(raw)
    if backend is None:
        value = "auto" if raw is None else os.environ.get("QFUSE_BACKEND", "auto")
        value = value.strip().lower()
        try:
            backend = _PARSED[raw] = Backend(value)
        except ValueError:
            raise BackendError(
                f"QFUSE_BACKEND={value!r} is not a backend; use one of auto, triton, reference."
            ) from None
    return backend


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
    from qfuse.kernels.gemm.dispatch import INTERPRETED

    return INTERPRETED


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
