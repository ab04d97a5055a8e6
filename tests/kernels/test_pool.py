"""``qfuse.kernels.pool.max_pool2d`` (and the ``qfuse::max_pool2d`` op) against ATen's float
max-pool: identical values for int8, fp8 and bf16 (a max is exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qfuse.kernels.pool import max_pool2d
from qfuse.ops.pool import max_pool2d_call
from tests.optional import given, settings, st

FP8 = torch.float8_e4m3fn


def _input(shape, dtype, seed=0, channels_last=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    x = x.round().clamp(-128, 127).to(torch.int8) if dtype == torch.int8 else x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _reference(x, k, s, p, d, ceil):
    return F.max_pool2d(x.float(), k, s, p, d, ceil).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.int8, FP8, torch.bfloat16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize(
    "k, s, p, d, ceil",
    [(3, 2, 1, 1, False), (2, 2, 0, 1, False), (3, 1, 1, 1, False), (3, 2, 1, 2, True),
     (3, 2, 0, 1, True)],
    ids=["resnet-stem", "2x2", "stride-1", "dilated-ceil", "ceil"],
)
def test_matches_aten(device, dtype, k, s, p, d, ceil):
    x = _input((2, 5, 9, 8), dtype).to(device)
    out = max_pool2d(x, [k, k], [s, s], [p, p], [d, d], ceil)
    ref = _reference(x.cpu(), k, s, p, d, ceil)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu().float(), ref.float())


@pytest.mark.parametrize("c", [16, 64])
def test_padding_never_wins_over_all_negative_windows(device, c):
    """An asymmetric int8 ReLU output is mostly its zero point, -128: a padding tap read as
    anything above it wins the border windows. Caught on the H100 only (vectorized int8 loads
    with ``other=-128``); random inputs rarely leave a border window all negative."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, -100, (2, c, 16, 16), generator=g, dtype=torch.int8)
    x = x.contiguous(memory_format=torch.channels_last).to(device)
    out = max_pool2d(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    assert torch.equal(out.cpu(), _reference(x.cpu(), 3, 2, 1, 1, False))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 2), c=st.integers(1, 40), h=st.integers(1, 9), w=st.integers(1, 9),
       k=st.integers(1, 3), s=st.integers(1, 3), seed=st.integers(0, 100))
def test_shape_fuzz(n, c, h, w, k, s, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = k // 2
    if h + 2 * p < k or w + 2 * p < k:
        return
    x = _input((n, c, h, w), torch.int8, seed, channels_last=seed % 2 == 0).to(device)
    out = max_pool2d(x, [k, k], [s, s], [p, p], [1, 1], False)
    assert torch.equal(out.cpu(), _reference(x.cpu(), k, s, p, 1, False))


def test_op_reference_path_on_cpu():
    """Without the interpreter's forced backend, CPU tensors pool through ATen in float32."""
    x = _input((1, 3, 6, 6), torch.int8)
    out = torch.ops.qfuse.max_pool2d(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    assert torch.equal(out, _reference(x, 3, 2, 1, 1, False))
    assert torch.equal(max_pool2d_call(x, [3, 3], [2, 2], [1, 1], [1, 1], False), out)
