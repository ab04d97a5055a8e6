"""4-bit weights (``qfuse.int4``, ``QLinear4``, ``QConfig.w4a16/w4a8``, GPTQ with groups): the
numerics contract exactly, the layers against a float64 recomputation, and the flows (prepare →
convert → summary → save/load → ``output="model"``) on a small Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

import qfuse
from qfuse import int4
from qfuse.algorithms.gptq import GPTQ, gptq_round_groups
from qfuse.errors import ShapeError, UnsupportedError
from qfuse.nn.qlinear4 import QLinear4
from qfuse.ops.w4linear import W4Call, gemm_reference
from tests.models import tiny_llama


def test_pack_layout_is_compressed_tensors():
    """Code j of word w is column 8w + j, nibble j from the bottom, stored as q + 8."""
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 7, -1, 5]], dtype=torch.int8)
    packed = int4.pack(q)
    nibbles = [0, 1, 8, 9, 10, 11, 15, 7]
    word0 = sum(v << (4 * j) for j, v in enumerate(nibbles))
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == word0  # top nibble 7: the sign bit is clear
    assert packed[0, 1].item() == 5 + 8  # the partial word's padding is zero bits


@pytest.mark.parametrize("K", [1, 13, 83, 128])
def test_pack_round_trip(K):
    q = torch.randint(-8, 8, (7, K), dtype=torch.int8)
    assert torch.equal(int4.unpack(int4.pack(q), K), q)
    zp = torch.randint(-8, 8, (K, 3), dtype=torch.int8)
    assert torch.equal(int4.unpack_rows(int4.pack_rows(zp), K), zp)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [None, 8, 32])
def test_group_rounding_error_is_half_a_step(symmetric, group):
    w = torch.randn(5, 83) * torch.linspace(0.1, 3, 83)
    scale, zero = int4.group_qparams(w, group, symmetric)
    assert scale.shape == (5, int4.groups_of(83, group))
    q = int4.quantize_groups(w, scale, zero, group)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    err = (int4.dequantize_groups(q, scale, zero, group) - w).abs()
    assert bool((err <= int4.expand(scale, 83, group) * 0.5 + 1e-6).all())


def test_w4a8_reference_is_groupwise_integer_sums():
    torch.manual_seed(0)
    w, x = torch.randn(6, 40), torch.randn(3, 40)
    scale, zero = int4.group_qparams(w, 16, symmetric=False)  # groups 16, 16, 8
    q = int4.quantize_groups(w, scale, zero, 16)
    call = W4Call(int4.pack(q), scale, zero, None, 40, 16, act_bits=8)
    xs = (x.abs().amax(1) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    xq = torch.clamp(torch.round(x * torch.reciprocal(xs)[:, None]), -128, 127)
    codes = (q.long() - int4.expand(zero, 40, 16).long()).double()
    want = torch.zeros(3, 6, dtype=torch.float32)
    for g, k0 in enumerate(range(0, 40, 16)):
        acc = (xq[:, k0:k0 + 16].double() @ codes[:, k0:k0 + 16].t()).float()
        want = want + acc * scale[:, g]
    want = want * xs[:, None]
    torch.testing.assert_close(gemm_reference(x, call), want, rtol=0, atol=0)


def test_qlinear4_layer_and_rows():
    torch.manual_seed(1)
    w, b, x = torch.randn(8, 24), torch.randn(8), torch.randn(2, 5, 24)
    lin = QLinear4.from_float(w, b, group_size=8, symmetric=True, activation="gelu")
    deq = lin.dequantized_weight().double()
    want = torch.nn.functional.gelu(x.double() @ deq.t() + b.double()).float()
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    half = lin.rows(0, None, 2)
    torch.testing.assert_close(half(x), want[..., ::2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="built for 24"):
        lin(torch.randn(2, 23))


def test_config_validation():
    assert qfuse.QConfig.from_dict(qfuse.QConfig.w4a16(64).to_dict()) == qfuse.QConfig.w4a16(64)
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        qfuse.QConfig.w4a16(100)
    with pytest.raises(UnsupportedError, match="4-bit weights only"):
        qfuse.QConfig(group_size=128)
    with pytest.raises(UnsupportedError, match="int8 activations"):
        qfuse.QConfig(dtype=torch.float8_e4m3fn, weight_bits=4)
    with pytest.raises(UnsupportedError, match="W4A8 quantizes activations symmetrically"):
        qfuse.QConfig(weight_bits=4, symmetric=False)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_groups_beats_rtn_on_the_grid(symmetric, act_order):
    torch.manual_seed(2)
    x = torch.randn(512, 48) @ torch.randn(48, 48)
    w = torch.randn(10, 48)
    q, (scale, zero) = gptq_round_groups(w, x.T @ x / 512, 16, symmetric,
                                         GPTQ(act_order=act_order, block_size=16))
    codes = int4.quantize_groups(q, scale, zero, 16)  # every entry is on its group's grid
    torch.testing.assert_close(int4.dequantize_groups(codes, scale, zero, 16), q, rtol=0,
                               atol=1e-6)
    rtn = int4.fake_quantize_groups(w, 16, symmetric)
    assert ((q - w) @ x.T).norm() < 0.9 * ((rtn - w) @ x.T).norm()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=2)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.parametrize("config", [
    qfuse.QConfig.w4a16(32),
    pytest.param(qfuse.QConfig.w4a16(None, False), marks=pytest.mark.slow),
    qfuse.QConfig.w4a8(32),
    pytest.param(qfuse.QConfig.w4a8(32, dynamic=False), marks=pytest.mark.slow),
], ids=["w4a16_g32", "w4a16_channel_asym", "w4a8_dynamic", "w4a8_static"])
def test_flow_graph_model_save_load(llama, config, tmp_path):
    ids = torch.randint(0, 96, (2, 10))
    prepared = qfuse.prepare(llama, config, (), example_kwargs={"input_ids": ids},
                             gptq=qfuse.GPTQ())
    for _ in range(3):
        prepared(input_ids=torch.randint(0, 96, (2, 10)))
    graph = qfuse.convert(prepared)
    ref = llama(input_ids=ids).logits
    got = _logits(graph(input_ids=ids))
    assert float(((got - ref).norm() / ref.norm()).detach()) < 0.3  # 4-bit, random Llama
    rows = [r for r in qfuse.summary(graph).rows if r["precision"] != "float"]
    want = {"w4a16 g32", "w4a16 per-channel asym", "w4a8 g32"}
    assert {r["precision"] for r in rows} <= want and len(rows) == 8  # tied LM head stays float
    assert all(r["output"] == "float" and "GPTQ" in r["note"] for r in rows)
    path = tmp_path / "m.safetensors"
    qfuse.save(graph, path)
    again = qfuse.load(path, llama, (), example_kwargs={"input_ids": ids})
    torch.testing.assert_close(_logits(again(input_ids=ids)), got, rtol=0, atol=0)
    model = qfuse.convert(prepared, output="model")
    assert type(model) is LlamaForCausalLM
    torch.testing.assert_close(model(input_ids=ids).logits, got, rtol=1e-5, atol=1e-5)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (2, 13)
    # a swapped layer faces its parent with an empty float ``weight``; its dequantized weight
    # still comes from the codes
    q = model.model.layers[0].self_attn.o_proj
    assert q.weight.numel() == 0
    torch.testing.assert_close(q.dequantized_weight(), graph.get_submodule(
        "model.layers.0.self_attn.o_proj").dequantized_weight(), rtol=0, atol=0)


def test_convs_are_refused_with_the_fix():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    prepared = qfuse.prepare(model, qfuse.QConfig.w4a16(None), (x,))
    with pytest.raises(UnsupportedError, match="keep_float"):
        qfuse.convert(prepared)
