"""One activation table (``kernels.common.EPILOGUE_ACTIVATIONS``): every entry has its reference
twin and its kernel branch, and the kernel computes what the reference does."""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.common import EPILOGUE_ACTIVATIONS, GATED_ACTIVATIONS, out_features
from qfuse.ops import reference
from tests.kernels.test_qgemm import check, make_case


def test_every_activation_has_a_reference_twin():
    codes = [a.code for a in EPILOGUE_ACTIVATIONS.values()]
    assert len(set(codes)) == len(codes)
    for name, act in EPILOGUE_ACTIVATIONS.items():
        twin = act.gate or name
        assert twin in reference.ACTIVATIONS, f"{name}: no reference twin for {twin!r}"
    assert set(GATED_ACTIVATIONS) == {n for n, a in EPILOGUE_ACTIVATIONS.items() if a.gate}
    assert out_features(8, "swiglu") == 4 and out_features(8, "gelu") == 8


@pytest.mark.parametrize("act", sorted(EPILOGUE_ACTIVATIONS))
def test_kernel_branch_matches_reference(device, act):
    gated = EPILOGUE_ACTIVATIONS[act].gate is not None
    check(make_case(5, 32, 16 if gated else 12, device, act=act, out_dtype=torch.int8))
