"""Test fixtures; the environment (Triton interpreter on) is set in the root conftest.py.
GPU-marked tests skip without CUDA."""

import pytest
import torch


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
