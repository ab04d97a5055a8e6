"""qfuse.export_compressed_tensors / qfuse.load_compressed_tensors, proven by the real consumers:
transformers' ``from_pretrained`` (CompressedTensorsHfQuantizer) and compressed-tensors' own
``apply_quantization_config`` + ``ModelCompressor`` (what llm-compressor and transformers call).

Six cases: a Llama-style causal LM and a BERT-style encoder (small configs, random weights),
each converted int8 static, int8 dynamic and fp8 static.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file
from torch import nn

import qfuse
from qfuse.errors import FormatError, QFuseError, UnsupportedError
from qfuse.export.checks import same_outputs
from qfuse.fusion.patterns import GATED
from qfuse.fusion.siblings import merged_path
from qfuse.primitives import dequantize
from qfuse.state import get_state

# Outputs of the checkpoint run by transformers against qfuse's CPU reference, as
# max|y_ct - y_qfuse| / max|y_qfuse|. Both run the same integer codes and scales; they differ in
# arithmetic only: compressed-tensors rounds x / scale, qfuse x * (1 / scale), and computes the
# GEMM in float where qfuse accumulates int32. Static scales: float rounding (measured <= 3e-7
# on these models). Dynamic per-token: each token's largest negative value sits exactly on
# -127.5 scale units, where x / s rounds to -128 and x * (1/s) may land a hair inside and round
# to -127: one code per token apart, ~1% of the output here.
BOUND = {"int8_static": 1e-5, "int8_dynamic": 3e-2, "fp8_static": 1e-5}
CONFIGS = {
    "int8_static": qfuse.QConfig.int8_static(),
    "int8_dynamic": qfuse.QConfig.int8_dynamic(),
    "fp8_static": qfuse.QConfig.fp8_static(),
}
ARCHS = ("llama", "bert")
OUTPUTS = ("logits", "last_hidden_state", "pooler_output")


def _float_model(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=32)
    return transformers.BertModel(config).eval()


@dataclass
class Case:
    arch: str
    config: str
    float_model: nn.Module
    ids: torch.Tensor
    prepared: nn.Module
    qmodel: nn.Module
    folder: str


_CASES: dict = {}


@pytest.fixture
def case(request, tmp_path_factory) -> Case:
    """The converted model and its exported folder, built once per (arch, config)."""
    arch, config = request.param
    if (arch, config) not in _CASES:
        model = _float_model(arch)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 96, (2, 8), generator=g)
        prepared = qfuse.prepare(model, CONFIGS[config], (ids,))
        for _ in range(2):
            prepared(torch.randint(0, 96, (2, 8), generator=g))
        # Llama keeps lm_head float, as llm-compressor's recipes do: it lands in `ignore`.
        keep = {"lm_head": "kept float"} if arch == "llama" else {}
        qmodel = qfuse.convert(prepared, keep_float=keep)
        folder = str(tmp_path_factory.mktemp(f"{arch}-{config}") / "checkpoint")
        qfuse.export_compressed_tensors(qmodel, folder)
        _CASES[arch, config] = Case(arch, config, model, torch.randint(0, 96, (2, 8), generator=g),
                                    prepared, qmodel, folder)
    return _CASES[arch, config]


CASES = [pytest.param((a, c), id=f"{a}-{c}") for a in ARCHS for c in CONFIGS]


def _outputs(out) -> dict[str, torch.Tensor]:
    return {k: out[k] for k in OUTPUTS if k in out}


def _expected_dequantized(case: Case) -> dict[str, torch.Tensor]:
    """Each quantized Linear's weight as qfuse dequantizes it, found independently of the
    exporter: merged layers split by the float model's member sizes (gate/up interleaved)."""
    state = get_state(case.qmodel)
    groups = {merged_path(g): g for g in state.merged}
    out = {}
    for record in state.layers:
        mod = case.qmodel.get_submodule(record.name)
        weight = dequantize(mod.weight, mod.weight_scale, axis=0)
        members = groups.get(record.name, [record.name])
        start = 0
        for i, member in enumerate(members):
            if mod.activation in GATED:
                out[member] = weight[i::2]
                continue
            rows = case.float_model.get_submodule(member).out_features
            out[member] = weight[start:start + rows]
            start += rows
    return out


def _ct_loader(folder: str) -> nn.Module:
    """The checkpoint loaded by compressed-tensors itself: its config applied to the float
    architecture, compressed, the file's tensors loaded, then decompressed."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = getattr(transformers, config.architectures[0])(config).eval()
    apply_quantization_config(model, qc)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    result = model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")),
                                   strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= set(getattr(model, "all_tied_weights_keys", {}))
    compressor.decompress_model(model)
    return model


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_checkpoint_is_what_consumers_load(case):
    with open(os.path.join(case.folder, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    QuantizationConfig.model_validate(qc)
    (group,) = qc["config_groups"].values()
    fp8 = case.config.startswith("fp8")
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == group["format"] == ("float-quantized" if fp8 else "int-quantized")
    assert group["targets"] == ["Linear"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["symmetric"]
    dynamic = case.config.endswith("dynamic")
    assert group["input_activations"]["strategy"] == ("token" if dynamic else "tensor")
    assert group["input_activations"]["dynamic"] is dynamic
    assert qc["ignore"] == (["lm_head"] if case.arch == "llama" else [])

    tensors = load_file(os.path.join(case.folder, "model.safetensors"))
    expected = _expected_dequantized(case)
    for name, weight in expected.items():
        assert tensors[f"{name}.weight"].dtype == (torch.float8_e4m3fn if fp8 else torch.int8)
        assert tensors[f"{name}.weight_scale"].shape == (weight.shape[0], 1)
        assert (f"{name}.input_scale" in tensors) is not dynamic
    assert not any("proj_" in k or "query_key_value" in k for k in tensors)  # merged: split back

    ct_model = _ct_loader(case.folder)
    for name, weight in expected.items():
        assert torch.equal(ct_model.get_submodule(name).weight, weight), name

    auto = transformers.AutoModelForCausalLM if case.arch == "llama" else transformers.AutoModel
    hf = auto.from_pretrained(case.folder)
    with torch.no_grad():
        want, got = _outputs(case.qmodel(case.ids)), _outputs(hf(case.ids))
    assert want.keys() == got.keys() and want
    for key in want:
        err = ((got[key] - want[key]).abs().max() / want[key].abs().max()).item()
        assert err <= BOUND[case.config], f"{key}: {err:.3g}"


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_reimport_runs_bit_identically(case):
    back = qfuse.load_compressed_tensors(case.folder, (case.ids,))
    with torch.no_grad():
        assert same_outputs(case.qmodel(case.ids), back(case.ids))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "note"} for r in rows]  # noqa: E731
    assert strip(qfuse.summary(back).rows) == strip(qfuse.summary(case.qmodel).rows)
