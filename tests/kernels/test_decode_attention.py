"""``kernels.decode_attention`` against ``ops.decode_attention.reference`` and against what
transformers runs (``repeat_kv`` + SDPA): under the interpreter on CPU (small shapes, small key
tiles and fixed split counts so the online softmax and the split combine both run), and on a GPU
(``-m gpu``) at TinyLlama's shapes, compiled and inside a replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qfuse.errors import DeviceError, ShapeError, UnsupportedError
from qfuse.kernels.attention.decode import DecodeSchedule, decode_attention, pick_splits
from qfuse.ops.decode_attention import INTERPRETED, reference


def sdpa(q, k, v, mask, scale=None):
    """transformers' path: the cache repeated per query head, SDPA in float32, [B, Sq, H, D]."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(G, dim=1) for t in (k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    o = F.scaled_dot_product_attention(q.float(), k, v, mask, scale=scale)
    return o.transpose(1, 2).to(q.dtype)


def inputs(B, H, Hkv, Sq, L, D, dtype, device, seed=0):
    """q as Llama makes it (a [B, Sq, H, D] projection viewed and transposed: not contiguous),
    k and v a [B, Hkv, L, D] cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(device)
    return q, k, v


def cache_mask(B, Sq, L, filled, pad, device):
    """A static cache's boolean [B, 1, Sq, L]: sample b's first ``pad[b]`` slots are left
    padding, slots past ``filled`` (plus the causal offset of each query row) are empty."""
    pos = torch.arange(L)
    rows = []
    for b in range(B):
        row = [(pos >= pad[b]) & (pos <= filled - Sq + i) for i in range(Sq)]
        rows.append(torch.stack(row))
    return torch.stack(rows)[:, None].to(device)


def check(out, q, k, v, mask, scale=None):
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) and out.is_contiguous()
    assert out.dtype == q.dtype
    cpu = [t.cpu() if t is not None else None for t in (q, k, v, mask)]
    ref = reference(*cpu, scale)
    tol = 2e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(ref.float(), sdpa(*cpu, scale).float(), rtol=tol, atol=tol)


CASES = [  # (G, Sq, L, D, splits, dtype)
    (1, 1, 37, 16, 3, torch.float32),
    (2, 3, 70, 64, 4, torch.bfloat16),
    (4, 1, 70, 16, 2, torch.float16),
    (4, 3, 37, 16, 1, torch.float32),
    (2, 1, 37, 64, 5, torch.float32),
]


@pytest.mark.parametrize("mask_form", ["none", "bool", "additive"])
@pytest.mark.parametrize("G,Sq,L,D,splits,dtype", CASES)
def test_against_reference_and_sdpa(device, G, Sq, L, D, splits, dtype, mask_form):
    B, Hkv = 2, 2
    q, k, v = inputs(B, G * Hkv, Hkv, Sq, L, D, dtype, device)
    assert q.stride(1) == D  # heads inside a position: the transposed projection
    mask = None
    if mask_form != "none":
        mask = cache_mask(B, Sq, L, filled=L - 5, pad=[0, 4], device=device)
    if mask_form == "additive":  # transformers' float form: finfo.min where masked
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, torch.finfo(dtype).min)
    sched = DecodeSchedule(block_l=16, splits=splits)
    out = decode_attention(q, k, v, mask, None, INTERPRETED, schedule=sched)
    check(out, q, k, v, mask)
    if mask_form == "bool":  # the masked keys really are ignored
        k2, v2 = k.clone(), v.clone()
        k2[:, :, L - 3:], v2[:, :, L - 3:] = 50.0, -50.0
        k2[1, :, :2], v2[1, :, :2] = 50.0, -50.0
        out2 = decode_attention(q, k2, v2, mask, None, INTERPRETED, schedule=sched)
        assert torch.equal(out, out2)


def test_per_head_float_mask_and_scale(device):
    """A mask with a head dim (read per query head) and -inf entries; a non-default scale."""
    q, k, v = inputs(1, 4, 2, 2, 40, 16, torch.float32, device, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = torch.randn(1, 4, 2, 40, generator=g).to(device)
    mask[0, 1, :, 10:] = float("-inf")
    out = decode_attention(q, k, v, mask, 0.3, INTERPRETED,
                           schedule=DecodeSchedule(block_l=16, splits=3))
    check(out, q, k, v, mask, scale=0.3)


@pytest.mark.parametrize("form", ["bool", "neg_inf", "finfo_min"])
def test_fully_masked_row(device, form):
    """Every key dropped (False / -inf): 0, as SDPA's safe softmax gives, in every split;
    every key at finfo.min: the average of v, as SDPA gives."""
    q, k, v = inputs(1, 4, 2, 1, 40, 16, torch.float32, device, seed=5)
    keep = torch.ones(1, 4, 1, 40, dtype=torch.bool, device=device)
    keep[0, 2] = False
    if form == "bool":
        mask = keep
    else:
        fill = float("-inf") if form == "neg_inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(keep.shape, device=device).masked_fill(~keep, fill)
    out = decode_attention(q, k, v, mask, None, INTERPRETED,
                           schedule=DecodeSchedule(block_l=16, splits=3))
    check(out, q, k, v, mask)
    row = out[0, 0, 2].cpu()
    if form == "finfo_min":
        torch.testing.assert_close(row, v[0, 1].cpu().mean(0), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(row, torch.zeros(16))
    assert torch.isfinite(out).all()


def test_default_schedule_and_split_rule(device):
    q, k, v = inputs(1, 8, 2, 1, 50, 24, torch.bfloat16, device)
    check(decode_attention(q, k, v, None, None, INTERPRETED), q, k, v, None)
    assert pick_splits(4, 600, 64, 132) == (10, 64)  # 10 tiles: one per split
    assert pick_splits(32, 8192, 64, 132) == (9, 960)  # 9 splits of 15 tiles
    assert pick_splits(4, 10, 64, 132) == (1, 64)


def test_op_matches_reference_and_compiles_on_cpu():
    from qfuse.ops.decode_attention import decode_attention as op

    q, k, v = inputs(1, 4, 2, 1, 20, 16, torch.float32, "cpu")
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    mask[..., 15:] = False
    out = op(q, k, v, mask, None)
    check(out, q, k, v, mask)
    fake = torch.library.opcheck(torch.ops.qfuse.decode_attention.default, (q, k, v, mask, None),
                                 test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in fake.values())


def test_bad_inputs_are_named():
    q, k, v = inputs(1, 4, 2, 1, 8, 16, torch.float32, "cpu")
    run = lambda *a: decode_attention(*a, None, INTERPRETED)  # noqa: E731
    with pytest.raises(ShapeError, match="must be"):
        run(q[0], k, v, None)
    with pytest.raises(ShapeError, match="not a multiple"):
        run(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), None)
    with pytest.raises(ShapeError, match="share batch"):
        run(q, k, v[:, :, :5], None)
    with pytest.raises(UnsupportedError, match="equal head dims"):
        run(q, k, torch.randn(1, 2, 8, 32), None)
    with pytest.raises(UnsupportedError, match="head dim 300"):
        big = torch.randn(1, 2, 8, 300)
        run(torch.randn(1, 4, 1, 300), big, big, None)
    with pytest.raises(UnsupportedError, match="dtypes"):
        run(q, k.half(), v, None)
    with pytest.raises(UnsupportedError, match="rows"):
        run(torch.randn(1, 4, 80, 16), k, v, None)
    with pytest.raises(UnsupportedError, match="mask dtype"):
        run(q, k, v, torch.ones(1, 1, 1, 8, dtype=torch.int32))
    with pytest.raises(ShapeError, match="does not broadcast"):
        run(q, k, v, torch.ones(1, 1, 1, 9, dtype=torch.bool))
    with pytest.raises(DeviceError, match="one device"):
        run(q, k, v, torch.ones(1, 1, 1, 8, dtype=torch.bool, device="meta"))


# ---- GPU: TinyLlama's decode shapes ----

def _tinyllama(B, L, seed=0):
    q, k, v = inputs(B, 32, 4, 1, L, 64, torch.bfloat16, "cuda", seed)
    mask = cache_mask(B, 1, L, filled=L - 17, pad=[3 * b for b in range(B)], device="cuda")
    return q, k, v, mask


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("L", [600, 2048])
def test_gpu_tinyllama(B, L):
    q, k, v, mask = _tinyllama(B, L)
    out = torch.ops.qfuse.decode_attention(q, k, v, mask, None)
    check(out, q, k, v, mask)
    again = torch.ops.qfuse.decode_attention(q, k, v, mask, None)
    assert torch.equal(out, again)  # the split combine is in a fixed order


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_compiled_fullgraph(B):
    q, k, v, mask = _tinyllama(B, 600)
    fn = torch.compile(lambda q, k, v, m: torch.ops.qfuse.decode_attention(q, k, v, m, 0.125),
                       fullgraph=True)
    out = fn(q, k, v, mask)
    check(out, q, k, v, mask, scale=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("B,L", [(1, 600), (4, 2048)])
def test_gpu_cuda_graph_replays(B, L):
    """Captured once, replayed twice with new values in the same buffers: the arrival counters
    reset themselves, so every replay combines its own splits."""
    q, k, v, mask = _tinyllama(B, L)
    op = torch.ops.qfuse.decode_attention
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(q, k, v, mask, None)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, k, v, mask, None)
    for seed in (1, 2):
        q2, k2, v2, mask2 = _tinyllama(B, L, seed)
        mask2[..., L // 2:] = False
        for dst, src in ((q, q2), (k, k2), (v, v2), (mask, mask2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out, q, k, v, mask)
