"""4-bit compressed-tensors ``pack_quantized`` export and import (``qfuse/export/ct_int4.py``):
transformers (with compressed-tensors) loads qfuse's export and computes the same logits up to
float32 sum order; qfuse's import gives back the exported codes and scales exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import qfuse
from qfuse.errors import UnsupportedError
from qfuse.export.ct_int4 import export_compressed_tensors_w4, load_compressed_tensors_w4
from qfuse.nn.qlinear4 import QLinear4


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _convert(llama, config):
    ids = torch.randint(0, 96, (2, 10))
    prepared = qfuse.prepare(llama, config, (), example_kwargs={"input_ids": ids})
    return qfuse.convert(prepared, output="model"), ids


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QLinear4)}


@pytest.mark.parametrize("config", [qfuse.QConfig.w4a16(32), qfuse.QConfig.w4a16(None),
                                    qfuse.QConfig.w4a16(32, symmetric=False)],
                         ids=["g32", "channel", "g32_asym"])
def test_round_trip_through_qfuse(llama, config, tmp_path):
    model, ids = _convert(llama, config)
    export_compressed_tensors_w4(model, tmp_path / "ct")
    back = load_compressed_tensors_w4(tmp_path / "ct")
    layers = _layers(back)
    assert sorted(layers) == sorted(f"model.layers.0.{n}" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    # the merged gate/up's interleaved rows came back as the two Linears' own
    gate_up = model.model.layers[0].mlp.gate_up
    for name, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        mine = layers[f"model.layers.0.mlp.{name}"]
        assert torch.equal(mine._buffers["weight"], gate_up._buffers["weight"][rows])
        assert torch.equal(mine.weight_scale, gate_up.weight_scale[rows])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = back(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_public_export_and_load_take_4_bit_models(llama, tmp_path):
    """``qfuse.export_compressed_tensors`` writes a 4-bit model as pack-quantized and
    ``qfuse.load_compressed_tensors`` reads it back (as the model; a graph is refused)."""
    model, ids = _convert(llama, qfuse.QConfig.w4a16(32))
    qfuse.export_compressed_tensors(model, tmp_path / "ct")
    back = qfuse.load_compressed_tensors(tmp_path / "ct", (), output="model")
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(qfuse.UnsupportedError, match="output='model'"):
        qfuse.load_compressed_tensors(tmp_path / "ct", (), {"input_ids": ids})


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="needs compressed-tensors")
@pytest.mark.parametrize("group", [32, None], ids=["g32", "channel"])
def test_transformers_loads_the_export(llama, group, tmp_path):
    model, ids = _convert(llama, qfuse.QConfig.w4a16(group))
    export_compressed_tensors_w4(model, tmp_path / "ct")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_refusals_name_the_layer_and_fix(llama, tmp_path):
    model, _ = _convert(llama, qfuse.QConfig.w4a16(48))  # 64 / 48: a short last group
    with pytest.raises(UnsupportedError, match="group size that divides"):
        export_compressed_tensors_w4(model, tmp_path / "a")
    model, _ = _convert(llama, qfuse.QConfig.w4a8(32))
    with pytest.raises(UnsupportedError, match="W4A16"):
        export_compressed_tensors_w4(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="needs compressed-tensors")
@pytest.mark.parametrize("K", [8, 83, 576])
def test_packing_is_compressed_tensors_own(K):
    """``qfuse.int4.pack`` against compressed-tensors' ``pack_to_int32``: weights along K, zero
    points along N (llm-compressor's W4A16 folders load bit for bit: their logits on a SmolLM2
    window equalled transformers' own load, max difference 0.0)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from qfuse import int4

    q = torch.randint(-8, 8, (7, K), dtype=torch.int8)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))
    zp = torch.randint(-8, 8, (K, 3), dtype=torch.int8)
    assert torch.equal(int4.pack_rows(zp), pack_to_int32(zp, 4, packed_dim=0))
