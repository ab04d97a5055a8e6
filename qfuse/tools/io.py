"""Files the tools write: whole or not at all (temp file + rename, ``qfuse.export.atomic``)."""

from __future__ import annotations

import os

from qfuse.export.atomic import atomic_path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.txt")
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
    """``fig.savefig`` to a temp file beside ``path`` (same extension), then rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **kwargs)
    return os.fspath(path)
