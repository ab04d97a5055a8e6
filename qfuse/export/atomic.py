"""Atomic file writes: every exporter writes a temp file beside the target, then renames it.

``os.replace`` within one directory is atomic on POSIX and Windows, so a reader sees either the old
file or the complete new one, never a half-written file — and a failed or interrupted write leaves
the old file (if any) untouched and no temp file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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
