"""Progress bars for long work (calibration, GPTQ, sensitivity, auto_fallback, sweeps)."""

from __future__ import annotations

import os
import sys


def progress(iterable, desc: str, quiet: bool = False, total: int | None = None):
    """``tqdm`` over ``iterable``: silent when ``quiet``, when stderr is not a terminal (logs, CI)
    or with ``QFUSE_PROGRESS=0``.

    Example:
        >>> [i for i in progress(range(3), "counting", quiet=True)]
        [0, 1, 2]
    """
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty() or os.environ.get("QFUSE_PROGRESS") == "0"
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False)


def progress_bar(desc: str, quiet: bool = False, total: int | None = None):
    """A ``tqdm`` bar to ``update()`` by hand (work whose count is known only as it goes), quiet
    on the same terms as ``progress``."""
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty() or os.environ.get("QFUSE_PROGRESS") == "0"
    return tqdm(desc=desc, total=total, disable=disable, leave=False)
