"""``kernels.attention`` against ``ops.attention._reference`` (SDPA in float32, the cast to the
model's float dtype, the reference quantizer): under the interpreter on CPU (small shapes, small
tiles so the online softmax runs over several key blocks), on a GPU (``-m gpu``) at the shapes
BERT-base and MiniLM run."""

from __future__ import annotations

import pytest
import torch

from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.attention.encoder import AttentionSchedule, attention, pick_schedule
from qfuse.ops.attention import INTERPRETED, _reference

FP8 = torch.float8_e4m3fn
SMALL = AttentionSchedule(16, 16, 4, 2)  # several query and key blocks at S = 21, 29


def qkv_views(B, S, H, D, dtype, device, seed=0):
    """q, k, v [B, H, S, D] as views of one fused-QKV GEMM output [B, S, 3*H*D] (no copy)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, S, 3 * H * D, generator=g) * 1.5).to(dtype).to(device)
    return [t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1)]


def padding_mask(B, S, device, form="square"):
    """Sample b keeps its first S - 3*b keys (export's boolean [B, 1, S, S], or [B, 1, 1, S])."""
    keep = torch.arange(S)[None, :] < (S - 3 * torch.arange(B))[:, None]
    mask = keep[:, None, None, :]
    return (mask.expand(B, 1, S, S).contiguous() if form == "square" else mask).to(device)


def check(out, ref, out_dtype, inv, float_dtype):
    """Float: within the float dtype's rounding (P is rounded to it before the PV product, as
    the GPU's flash kernels do). int8: at most one step apart, on few elements. fp8: in the
    attention's units, one e4m3 step (1/8 relative) plus the float rounding (near zero the e4m3
    grid is finer than the attention's own bf16 error)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = out.cpu(), ref.cpu()
    tol = 1e-5 if float_dtype == torch.float32 else 2e-2
    if out_dtype == torch.int8:
        diff = (out.int() - ref.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.05
    elif out_dtype == FP8:
        y, r = out.float() / inv, ref.float() / inv
        assert ((y - r).abs() <= r.abs() / 8 + tol).all()
        assert (out.float() != ref.float()).float().mean() <= 0.1
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def run(q, k, v, mask, out_dtype, scale=None, zp=None, schedule=SMALL):
    inv = torch.tensor(60.0 if out_dtype == torch.int8 else 300.0, device=q.device)
    z = torch.tensor(zp, dtype=torch.int32, device=q.device) if zp is not None else None
    s = scale if scale is not None else q.shape[-1] ** -0.5
    out = attention(q, k, v, mask, scale, inv, z, out_dtype, INTERPRETED, schedule=schedule)
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (q, k, v, mask, inv, z)]
    ref = _reference(cpu[0], cpu[1], cpu[2], cpu[3], s, cpu[4], cpu[5], out_dtype)
    check(out, ref, out_dtype, float(inv), q.dtype)
    return out, ref


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.int8), (torch.bfloat16, FP8),
                                             (torch.bfloat16, "float"), (torch.float32, "float")],
                         ids=["bf16_int8", "bf16_fp8", "bf16", "fp32"])
def test_strided_qkv_with_padding_mask(device, dtype, out_dtype):
    q, k, v = qkv_views(3, 29, 2, 32, dtype, device)
    assert not q.is_contiguous()
    out_dtype = dtype if out_dtype == "float" else out_dtype
    run(q, k, v, padding_mask(3, 29, device), out_dtype, zp=3 if out_dtype == torch.int8 else None)


@pytest.mark.parametrize("form", ["square", "keys", "additive", "none"])
def test_mask_forms(device, form):
    q, k, v = qkv_views(2, 21, 2, 16, torch.bfloat16, device, seed=1)
    mask = None if form == "none" else padding_mask(2, 21, device, form)
    if form == "additive":  # transformers' form: finfo.min where masked
        mask = torch.zeros(mask.shape, dtype=torch.bfloat16, device=device).masked_fill(
            ~mask, torch.finfo(torch.bfloat16).min)
    out, _ = run(q, k, v, mask, torch.bfloat16, scale=0.3)
    if form != "none":  # the masked keys really are ignored: changing them changes nothing
        k2, v2 = k.clone(), v.clone()
        k2[1, :, 18:], v2[1, :, 18:] = 100.0, -100.0
        out2 = attention(q, k2, v2, mask, 0.3, None, None, torch.bfloat16, INTERPRETED,
                         schedule=SMALL)
        assert torch.equal(out, out2)


def test_a_row_with_every_key_masked_is_zero(device):
    """SDPA's safe softmax: a query whose keys are all masked gives 0, not NaN."""
    q, k, v = qkv_views(1, 9, 1, 16, torch.float32, device)
    mask = torch.ones(1, 1, 9, 9, dtype=torch.bool, device=device)
    mask[0, 0, 4] = False
    out, ref = run(q, k, v, mask, torch.float32)
    assert torch.equal(out[0, 4].cpu(), torch.zeros(16)) and torch.equal(ref[0, 4], out[0, 4].cpu())


def test_default_schedule_and_head_dim_not_a_power_of_two(device):
    q, k, v = qkv_views(1, 19, 3, 24, torch.bfloat16, device)
    run(q, k, v, None, torch.int8, schedule=None)
    assert pick_schedule(24, 19) == pick_schedule(32, 128)


def test_bad_inputs_are_named():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ShapeError, match="must be"):
        attention(q[0], q[0], q[0], None, None, None, None, torch.float32, INTERPRETED)
    with pytest.raises(ShapeError, match="no GQA"):
        attention(q, q[:, :1], q[:, :1], None, None, None, None, torch.float32, INTERPRETED)
    with pytest.raises(UnsupportedError, match="out_dtype"):
        attention(q, q, q, None, None, None, None, torch.float16, INTERPRETED)
    with pytest.raises(UnsupportedError, match="needs inv_scale"):
        attention(q, q, q, None, None, None, None, torch.int8, INTERPRETED)
    with pytest.raises(ShapeError, match="does not broadcast"):
        attention(q, q, q, torch.ones(3, 4, dtype=torch.bool), None, None, None, torch.float32,
                  INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 128, 12, 64), (8, 512, 12, 64), (32, 128, 12, 32),
                                   (1, 128, 12, 32), (4, 200, 8, 128)],
                         ids=["bert_32x128", "bert_8x512", "minilm_32x128", "minilm_1x128",
                              "d128_ragged"])
@pytest.mark.parametrize("out_dtype", [torch.int8, FP8, torch.bfloat16])
def test_gpu_real_shapes(shape, out_dtype):
    B, S, H, D = shape
    q, k, v = qkv_views(B, S, H, D, torch.bfloat16, "cuda")
    run(q, k, v, padding_mask(B, S, "cuda"), out_dtype, schedule=None)
