"""4-bit compressed-tensors ``pack_quantized`` export and import (``qfuse/export/ct_int4.py``):
transformers (with compressed-tensors) loads qfuse's export and computes the same logits up to
float32 sum order; qfuse's import gives back the exported codes and scales exactly.

``data/llmc_w4a16_g32`` and ``data/llmc_w4a16_asym_g32`` are checkpoints llm-compressor itself
wrote (``data/make_llmc_w4a16.py``: GPTQ with its W4A16 / W4A16_ASYM preset, group 32, on a tiny
random Llama), each with llm-compressor's logits for fixed ids (``llmc_reference.pt``,
transformers + compressed-tensors loading the folder). The tests reading them need neither
package: they run in CI."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import qfuse
from qfuse import int4
from qfuse.errors import UnsupportedError
from qfuse.export.ct_int4 import export_compressed_tensors_w4, load_compressed_tensors_w4
from qfuse.nn.qlinear4 import QLinear4
from qfuse.state import get_state
from tests.models import tiny_llama

DATA = Path(__file__).parent / "data"
LLMC = ["llmc_w4a16_g32", "llmc_w4a16_asym_g32"]
LLAMA_LINEARS = [f"model.layers.{i}.{n}" for i in range(2) for n in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=1)


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

    q = torch.randint(-8, 8, (7, K), dtype=torch.int8)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))
    zp = torch.randint(-8, 8, (K, 3), dtype=torch.int8)
    assert torch.equal(int4.pack_rows(zp), pack_to_int32(zp, 4, packed_dim=0))


# llm-compressor's own checkpoints -------------------------------------------------------------
def _nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """compressed-tensors' int32 packing undone without qfuse.int4: eight 4-bit values a word
    along the last dim, lowest nibble first, each stored as value + 8."""
    u = (packed.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF
    return (u.reshape(*packed.shape[:-1], -1)[..., :n] - 8).to(torch.int8)


@pytest.mark.parametrize("name", LLMC)
def test_llm_compressor_w4a16_checkpoint_loads_onto_qlinear4(name):
    """qfuse's public loader puts llm-compressor's codes, scales and zero points into QLinear4
    layers unchanged, and the model computes llm-compressor's logits: tolerance 1e-5 (float32
    sum order across torch builds; 0.0 where the fixture was made)."""
    path = DATA / name
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"]) == (4, 32, "group")
    symmetric = weights["symmetric"]
    assert symmetric == (name == "llmc_w4a16_g32")
    file = load_file(path / "model.safetensors")
    model = qfuse.load_compressed_tensors(path, (), output="model")
    layers = _layers(model)
    assert sorted(layers) == sorted(LLAMA_LINEARS)
    assert type(model.lm_head) is nn.Linear  # in llm-compressor's ignore list
    assert torch.equal(model.lm_head.weight, file["lm_head.weight"])
    for lname, layer in layers.items():
        packed, scale = file[f"{lname}.weight_packed"], file[f"{lname}.weight_scale"]
        n, k = file[f"{lname}.weight_shape"].tolist()
        assert (layer.group_size, layer.act_bits, layer.in_features, layer.out_features) == \
            (32, 16, k, n)
        assert layer._buffers["weight"].dtype == torch.int32
        assert torch.equal(layer._buffers["weight"], packed), lname  # the codes, as stored
        assert layer.weight_scale.dtype == scale.dtype and torch.equal(layer.weight_scale, scale)
        codes = _nibbles(packed, k)
        if symmetric:
            assert layer.weight_zero_point is None and f"{lname}.weight_zero_point" not in file
            zp = torch.zeros_like(scale, dtype=torch.int8)
        else:
            zp = _nibbles(file[f"{lname}.weight_zero_point"].t(), n).t()  # packed along N
            assert torch.equal(layer.weight_zero_point, zp), lname
        want = (codes.float() - zp.float().repeat_interleave(32, 1)) * \
            scale.repeat_interleave(32, 1)
        b = layer._buffers  # (a swapped layer's .weight faces its parent as float)
        mine = int4.dequantize_groups(int4.unpack(b["weight"], k), b["weight_scale"],
                                      b["weight_zero_point"], layer.group_size)
        torch.testing.assert_close(mine, want, rtol=0, atol=0)
    if not symmetric:  # the fixture really exercises zero points and the full code range
        zps = torch.cat([m.weight_zero_point.flatten() for m in layers.values()])
        assert zps.unique().numel() > 4
    ref = torch.load(path / "llmc_reference.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LLMC)
def test_a_loaded_llm_compressor_model_saves_and_exports(name, tmp_path):
    """The loaded model carries a qfuse record: save_pretrained writes qfuse's format, which
    from_pretrained reads back bit for bit; export writes llm-compressor's tensors back
    byte for byte."""
    path = DATA / name
    model = qfuse.load_compressed_tensors(path, (), output="model")
    rows = qfuse.summary(model).rows
    assert [r["name"] for r in rows] == LLAMA_LINEARS + ["lm_head"]
    assert rows[0]["precision"] == ("w4a16 g32" if "asym" not in name else "w4a16 g32 asym")
    model.save_pretrained(tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert record["quant_method"] == "qfuse"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert sorted(_layers(back)) == sorted(LLAMA_LINEARS)
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    ref = torch.load(path / "llmc_reference.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ref["input_ids"]).logits, ref["logits"],
                                   rtol=1e-5, atol=1e-5)
    qfuse.export_compressed_tensors(model, tmp_path / "ct")
    mine, theirs = load_file(tmp_path / "ct" / "model.safetensors"), load_file(
        path / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert get_state(back) is not None


def test_a_group_indexed_checkpoint_is_refused_naming_the_layer(tmp_path):
    """actorder='group' (a weight_g_idx per Linear) needs per-column group lookup."""
    shutil.copytree(DATA / "llmc_w4a16_g32", tmp_path / "ct")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight_g_idx"] = torch.arange(64, dtype=torch.int32) // 32
    save_file(tensors, tmp_path / "ct" / "model.safetensors")
    with pytest.raises(UnsupportedError, match=r"model\.layers\.1\.mlp\.up_proj.*actorder"):
        qfuse.load_compressed_tensors(tmp_path / "ct", (), output="model")
