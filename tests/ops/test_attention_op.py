"""``qfuse::attention_quant``: the op's reference and Triton paths agree, and the op works in
eager, under ``torch.compile(fullgraph=True)`` and through ``torch.export``."""

from __future__ import annotations

import pytest
import torch

import qfuse
from qfuse.ops.attention import INTERPRETED, attention_quant_call
from tests.kernels.test_attention import padding_mask

B, S, H, D = 2, 11, 2, 16
INV = torch.tensor(50.0)
# The Triton path on CPU tensors runs in the interpreter (CI); the GPU runs are the gpu tests.
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors")


class Block(torch.nn.Module):
    """The converted encoder's attention: fused-QKV output -> q, k, v views -> int8 rows."""

    def forward(self, qkv, mask):
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
        return attention_quant_call(q, k, v, mask, 0.25, INV, None, torch.int8)


def qkv_input(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, S, 3 * H * D, generator=g)).to(dtype), padding_mask(B, S, "cpu")


@needs_interpreter
def test_reference_and_triton_paths_agree():
    qkv, mask = qkv_input(torch.bfloat16)
    ref = Block()(qkv, mask)
    with qfuse.use_backend("triton"):
        out = Block()(qkv, mask)
    diff = (out.int() - ref.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.05


def test_opcheck():
    qkv, mask = qkv_input()
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
    zp = torch.tensor(2, dtype=torch.int32)
    torch.library.opcheck(torch.ops.qfuse.attention_quant.default,
                          (q, k, v, mask, 0.25, INV, zp, torch.int8),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_compile_fullgraph_and_export(backend):
    qkv, mask = qkv_input()
    with qfuse.use_backend(backend):
        expected = Block()(qkv, mask)
        compiled = torch.compile(Block(), backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(qkv, mask), expected)
    ep = torch.export.export(Block(), (qkv, mask))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.qfuse.attention_quant.default in ops
    assert not any("scaled_dot_product" in str(t) for t in ops)
    with qfuse.use_backend(backend):
        assert torch.equal(ep.module()(qkv, mask), expected)


def test_float_output_is_the_unfused_layout():
    qkv, mask = qkv_input()
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
    out = attention_quant_call(q, k, v, mask, None, None, None, torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, sdpa.transpose(1, 2).reshape(B, S, H * D))


@pytest.mark.gpu
def test_gpu_inductor_launch_matches_eager():
    """The eager paths (a first, plain launch; then the cached launch) and the traced one
    (``wrap_triton`` inside an Inductor graph) agree, with the bf16 strided views the converted
    graph hands them, and the op itself."""
    qkv, mask = qkv_input(torch.bfloat16)
    qkv, mask = qkv.cuda(), mask.cuda()
    global INV
    old, INV = INV, INV.cuda()
    try:
        first = Block()(qkv, mask)
        cached = Block()(qkv + 0, mask)  # another buffer: the cached launch's pointers
        compiled = torch.compile(Block(), fullgraph=True)(qkv, mask)
        assert torch.equal(cached, first) and torch.equal(compiled, first)
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
        op = torch.ops.qfuse.attention_quant(q, k, v, mask, 0.25, INV, None, torch.int8)
        assert torch.equal(op, first)
    finally:
        INV = old
