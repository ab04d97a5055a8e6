"""Optional test dependencies. A test that needs a missing package skips, naming it and the extra
that installs it; the other tests of its module still run (a GPU machine without the test extra
runs the kernel suites whole, less their property tests).

    from tests.optional import given, settings, st      # hypothesis, or skipping stand-ins
    sklearn = needs("sklearn", "recipes")                # in a test: the module, or a skip
"""

from __future__ import annotations

import pytest


def reason(package: str, extra: str | None = "test") -> str:
    """Why a test skips: ``package`` is missing, and what installs it (``extra``: the extra of
    pyproject.toml that lists it; None: no extra does, pip install it by name)."""
    how = f"pip install {package}" if extra is None else f"pip install -e .[{extra}]"
    return f"{package} is not installed ({how})"


def needs(package: str, extra: str | None = "test"):
    """``package`` imported, or the calling test (or module, at module level) skipped."""
    return pytest.importorskip(package, reason=reason(package, extra))


class _Absent:
    """Stands in for hypothesis' strategies and settings: any attribute or call is itself."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __iter__(self):  # list(HealthCheck)
        return iter(())


try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
except ModuleNotFoundError:
    HealthCheck = Phase = st = _Absent()

    def given(*args, **kwargs):
        return pytest.mark.skip(reason=reason("hypothesis"))

    def settings(*args, **kwargs):
        return lambda test: test
