"""Test fixtures; the environment (Triton interpreter on) is set in the root conftest.py.
GPU-marked tests skip without CUDA.

Under pytest-xdist (CI: ``-n 2`` on 2 cores) each worker computes on one thread (set in the root
conftest.py, before torch and numpy load), and tests are sent to workers a module at a time, so a
module's module-scoped fixtures and module-level caches (``_CASES`` and the like) are built once.
A subdirectory with its own conftest.py (export's ``make_case``, calibrate's ``llama``: session
fixtures) goes to one worker whole, so those are built once too; so do the directories in
``SHARED_FILES``.
"""

from functools import cache
from pathlib import Path

import pytest
import torch

# Directories whose modules write the same files: one worker runs them one after another.
SHARED_FILES = {
    # recipes/.cache/digits_net_seed0_e40.pt: ptq_digits and qat_digits train it when missing
    # and write it through one temp name (and would train it twice).
    "tests/recipes",
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` without ``--dist``: the module scheduling described above (an explicit ``--dist``
    mode is left to xdist). Not ``--dist loadgroup``: with pytest 9.2 its groups are silently
    dropped (pytest-xdist issue #1386)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    @cache
    def scope_of(module: str) -> str:
        for parent in Path(module).parents:
            if parent in (Path("."), Path("tests")):
                break
            if str(parent) in SHARED_FILES or (root / parent / "conftest.py").exists():
                return str(parent)
        return module

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid.split("::", 1)[0])

    return ModuleScheduling(config, log)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count (``bench.models.calib_large`` does) sets it for the
    tests after it on the same process: restore it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def device():
    """The device the current test targets: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
