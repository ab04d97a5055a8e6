"""Root pytest setup (applies to tests/ and to the docstring examples under qfuse/).

TRITON_INTERPRET must be set before anything imports triton kernels, so that the Triton kernels
run on CPU tensors in the interpreter.
"""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on 2 cores: one thread per worker for torch (OpenMP) and numpy (OpenBLAS: the
    # Triton interpreter's dots), set before either loads; the processes tests start inherit it.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"

# The docstring examples of modules that import an optional package at their top: not collected
# where it is missing (their tests skip, naming it), so ``pytest -m gpu`` collects without it.
OPTIONAL_MODULES = {
    "transformers": ["qfuse/integrations/transformers.py", "qfuse/integrations/attention.py"],
}
collect_ignore = [path for package, paths in OPTIONAL_MODULES.items()
                  if importlib.util.find_spec(package) is None for path in paths]


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow``: more cases of what CI already covers once (more parametrizations,
    every mode of a bench), run only with QFUSE_SLOW_TESTS=1: CI's 2 cores keep to 15 min."""
    if os.environ.get("QFUSE_SLOW_TESTS"):
        return
    import pytest

    skip = pytest.mark.skip(reason="slow: more cases of a covered path; set QFUSE_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
