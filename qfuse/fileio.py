"""Files qfuse writes and where its cache lives: one home for every writer in the package.

Atomic writes: every writer (exporters, reports, plots, the tuning and cost caches) writes a
temp file beside the target, then renames it. ``os.replace`` within one directory is atomic on
POSIX and Windows, so a reader sees either the old file or the complete new one, never a
half-written file — and a failed or interrupted write leaves the old file (if any) untouched and
no temp file behind. This module imports nothing from qfuse, so kernels may use it too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from collections.abc import Iterator


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: str) -> None:
    """Make the rename durable too (POSIX only: Windows cannot open a directory)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_parent(path: str) -> None:
    """Create ``path``'s folder (``qfuse.save("out/model.safetensors")`` into a new ``out``);
    ``QFuseError`` when ``path`` is a folder or its folder cannot be made."""
    from qfuse.errors import QFuseError

    if os.path.isdir(path):
        raise QFuseError(f"{path} is a folder; pass the path of a file inside it.")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        raise QFuseError(f"cannot create the folder of {path}: {exc.strerror}; pass a path in "
                         "a writable folder.") from exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp path in ``path``'s directory; when the block succeeds, move it onto ``path``.

    The temp name keeps the target's extension (``torch.export.save`` checks for ``.pt2``) and
    starts with a dot. The writer inside the block creates the file itself, so it gets the
    usual permissions.

    Example:
        >>> import os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "out.bin")
        >>> with atomic_path(target) as tmp:
        ...     with open(tmp, "wb") as f:
        ...         _ = f.write(b"done")
        >>> open(target, "rb").read(), os.listdir(os.path.dirname(target))
        (b'done', ['out.bin'])
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    ext = os.path.splitext(name)[1]
    ensure_parent(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.partial{ext}")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave the temp file behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one),
    creating its directory.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "sub", "a.txt")
        >>> _ = atomic_write_bytes(p, b"x")
        >>> open(p, "rb").read()
        b'x'
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return os.fspath(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    """``atomic_write_bytes`` of UTF-8 text.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.md")
        >>> _ = atomic_write_text(p, "# hi")
        >>> open(p).read()
        '# hi'
    """
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_savefig(fig, path: str | os.PathLike, **kwargs) -> str:
    """``fig.savefig`` (matplotlib) to a temp file beside ``path`` (same extension), then
    rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **kwargs)
    return os.fspath(path)


def cache_dir() -> str:
    """qfuse's per-user cache (tuned GEMM schedules, measured routing costs):
    ``$QFUSE_CACHE_DIR``, else ``~/.cache/qfuse``.

    ``$QFUSE_CACHE``, the routing cost cache's older name, is still honoured while
    ``QFUSE_CACHE_DIR`` is unset, with a ``FutureWarning`` naming ``QFUSE_CACHE_DIR`` (a
    ``FutureWarning`` because Python shows it to users by default; a ``DeprecationWarning``
    raised in a library is hidden). With both set, ``QFUSE_CACHE_DIR`` wins and the warning
    says the old one is ignored.

    Example:
        >>> import os
        >>> saved = os.environ.pop("QFUSE_CACHE_DIR", None)
        >>> os.environ["QFUSE_CACHE_DIR"] = "/tmp/qfuse-cache"
        >>> cache_dir()
        '/tmp/qfuse-cache'
        >>> del os.environ["QFUSE_CACHE_DIR"]
        >>> if saved is not None:
        ...     os.environ["QFUSE_CACHE_DIR"] = saved
    """
    path, old = os.environ.get("QFUSE_CACHE_DIR"), os.environ.get("QFUSE_CACHE")
    if old and old != path:
        use = "ignored: QFUSE_CACHE_DIR is set" if path else "read for now; set QFUSE_CACHE_DIR"
        warnings.warn(f"QFUSE_CACHE is qfuse's old name for QFUSE_CACHE_DIR ({use}).",
                      FutureWarning, stacklevel=2)
    return path or old or os.path.join(os.path.expanduser("~"), ".cache", "qfuse")
