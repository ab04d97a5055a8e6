"""Test setup: Triton runs in its interpreter on CPU tensors (must be set before qfuse imports
triton), torchao's CUDA extension warnings are silenced, and GPU tests skip without CUDA."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device the current test targets: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
