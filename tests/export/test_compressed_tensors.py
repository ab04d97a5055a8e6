"""qfuse.export_compressed_tensors / qfuse.load_compressed_tensors, proven by the real consumers:
transformers' ``from_pretrained`` (CompressedTensorsHfQuantizer) and compressed-tensors' own
``apply_quantization_config`` + ``ModelCompressor`` (what llm-compressor and transformers call).

Six cases: a Llama-style causal LM and a BERT-style encoder (small configs, random weights),
each converted int8 static, int8 dynamic and fp8 static; and BERT int8 static with asymmetric
activations (zero points; qfuse folds their correction into the bias, the file holds it unfolded).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="the test extra's compressed-tensors is not "
                    "installed (pip install -e .[test])")

import transformers  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn  # noqa: E402

import qfuse  # noqa: E402
from qfuse.errors import FormatError, QFuseError, UnsupportedError
from qfuse.export.checks import same_outputs
from qfuse.fusion.patterns import GATED
from qfuse.fusion.siblings import merged_path
from qfuse.primitives import dequantize
from qfuse.state import get_state

# Outputs of the checkpoint run by transformers against qfuse's CPU reference, as
# max|y_ct - y_qfuse| / max|y_qfuse|. Both run the same integer codes and scales; they differ in
# arithmetic only: compressed-tensors rounds x / scale, qfuse x * (1 / scale), and computes the
# GEMM in float where qfuse accumulates int32. Static scales: float rounding (measured
# 0.8e-7..3.6e-7 over five inputs per case). Dynamic per-token: a token whose largest magnitude
# is negative sits exactly on -127.5 scale units, which x / s rounds to -128 while x * (1/s) lands
# a hair inside for about 9% of tokens and rounds to -127: one code apart (measured 1.3e-3..8.3e-3).
BOUND = {"int8_static": 1e-5, "int8_dynamic": 3e-2, "fp8_static": 1e-5, "int8_asym": 1e-5}
CONFIGS = {
    "int8_static": qfuse.QConfig.int8_static(),
    "int8_dynamic": qfuse.QConfig.int8_dynamic(),
    "fp8_static": qfuse.QConfig.fp8_static(),
    "int8_asym": qfuse.QConfig.int8_static_asymmetric(),
}
ARCHS = ("llama", "bert")
OUTPUTS = ("logits", "last_hidden_state", "pooler_output")


def _float_model(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.BertConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
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


def _get_case(arch: str, config: str, tmp_path_factory) -> Case:
    """The converted model and its exported folder, built once per (arch, config)."""
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
        _CASES[arch, config] = Case(
            arch, config, model, torch.randint(0, 96, (2, 8), generator=g), prepared, qmodel, folder
        )
    return _CASES[arch, config]


@pytest.fixture
def case(request, tmp_path_factory) -> Case:
    return _get_case(*request.param, tmp_path_factory)


CASES = [
    pytest.param((a, c), id=f"{a}-{c}")
    for a in ARCHS
    for c in CONFIGS
    if c != "int8_asym" or a == "bert"
]


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
            out[member] = weight[start : start + rows]
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
    result = model.load_state_dict(
        load_file(os.path.join(folder, "model.safetensors")), strict=False
    )
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
    asym = case.config == "int8_asym"
    assert group["input_activations"]["symmetric"] is not asym
    assert qc["ignore"] == (["lm_head"] if case.arch == "llama" else [])

    tensors = load_file(os.path.join(case.folder, "model.safetensors"))
    expected = _expected_dequantized(case)
    for name, weight in expected.items():
        assert tensors[f"{name}.weight"].dtype == (torch.float8_e4m3fn if fp8 else torch.int8)
        assert tensors[f"{name}.weight_scale"].shape == (weight.shape[0], 1)
        assert (f"{name}.input_scale" in tensors) is not dynamic
        assert (f"{name}.input_zero_point" in tensors) is asym
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


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], indirect=True)
def test_reimport_on_cuda_runs_the_triton_kernels(case):
    """llama int8 / fp8 static, bert fp8 static: the checkpoint loaded onto the GPU runs qfuse's
    Triton kernels and agrees with the CPU model it was exported from."""
    back = qfuse.load_compressed_tensors(case.folder, (case.ids,), device="cuda")
    kernels = [r["kernel"] for r in qfuse.summary(back).rows if r["precision"] != "float"]
    assert kernels and all("triton" in k and "cuda" in k for k in kernels), kernels
    with torch.no_grad():
        want, got = _outputs(case.qmodel(case.ids)), _outputs(back(case.ids.cuda()))
    for key in want:  # GPU attention/softmax round differently from the CPU's; int8 one step
        err = ((got[key].cpu() - want[key]).abs().max() / want[key].abs().max()).item()
        assert err <= 5e-2, f"{key}: {err:.3g}"


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], indirect=True)  # llama, bert int8 static
def test_output_model_exports_the_same_checkpoint(case, tmp_path):
    """``convert(output="model")`` (Q/K/V as QSibling, Llama's MLP as one QGatedMLP) writes the
    same folder as the graph."""
    keep = {"lm_head": "kept float"} if case.arch == "llama" else {}
    swapped = qfuse.convert(case.prepared, keep_float=keep, output="model")
    qfuse.export_compressed_tensors(swapped, tmp_path / "swapped")
    want = load_file(os.path.join(case.folder, "model.safetensors"))
    got = load_file(tmp_path / "swapped" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    with (
        open(os.path.join(case.folder, "config.json")) as f,
        open(tmp_path / "swapped" / "config.json") as g,
    ):
        assert json.load(f) == json.load(g)


def test_a_model_without_a_module_its_config_builds_exports_what_it_has(tmp_path):
    """``BertModel(config, add_pooling_layer=False)``, swapped: the export rebuilds the
    architecture from the config, which has a pooler; the model has none, so the folder has
    none (it was refused: "holds no tensor for ['pooler.dense.weight', ...]"), and transformers
    loads it as the model was built."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, 64, (2, 8))
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), {"input_ids": ids})
    prepared(input_ids=ids)
    swapped = qfuse.convert(prepared, output="model")
    qfuse.export_compressed_tensors(swapped, tmp_path / "ct")
    assert not [k for k in load_file(tmp_path / "ct" / "model.safetensors") if "pooler" in k]
    back = transformers.BertModel.from_pretrained(tmp_path / "ct", add_pooling_layer=False)
    with torch.no_grad():
        want = swapped(input_ids=ids).last_hidden_state
        got = back(input_ids=ids).last_hidden_state
    assert (got - want).abs().max() <= BOUND["int8_static"] * want.abs().max()
    swapped.save_pretrained(tmp_path / "hf")  # qfuse's own format: the same model back
    again = transformers.BertModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).last_hidden_state, want)


def test_a_model_from_qfuse_load_exports_with_its_float_model(tmp_path, tmp_path_factory):
    case = _get_case("bert", "int8_static", tmp_path_factory)
    qfuse.save(case.qmodel, tmp_path / "q.safetensors")
    loaded = qfuse.load(tmp_path / "q.safetensors", _float_model("bert"), (case.ids,))
    with pytest.raises(QFuseError, match="float_model="):
        qfuse.export_compressed_tensors(loaded, tmp_path / "nope")
    qfuse.export_compressed_tensors(loaded, tmp_path / "out", float_model=_float_model("bert"))
    want = load_file(os.path.join(case.folder, "model.safetensors"))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_mixed_precision_writes_one_group_per_scheme(tmp_path, tmp_path_factory):
    """Layers converted to fp8 among int8 ones (``layer_dtypes``): two groups naming their
    layers, format mixed-precision; loads in both consumers and back into qfuse."""
    case = _get_case("bert", "int8_static", tmp_path_factory)
    fp8 = "encoder.layer.0.intermediate.dense"
    qmodel = qfuse.convert(case.prepared, layer_dtypes={fp8: torch.float8_e4m3fn})
    qfuse.export_compressed_tensors(qmodel, tmp_path / "mixed")
    with open(tmp_path / "mixed" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["format"] == "mixed-precision"
    groups = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert groups["float-quantized"] == [fp8] and fp8 not in groups["int-quantized"]
    assert len(groups["int-quantized"]) == 6  # query, key, value, attention.output, output, pooler
    ct_model = _ct_loader(str(tmp_path / "mixed"))
    assert ct_model.get_submodule(fp8).quantization_scheme.weights.type == "float"
    back = qfuse.load_compressed_tensors(tmp_path / "mixed", (case.ids,))
    with torch.no_grad():
        assert same_outputs(qmodel(case.ids), back(case.ids))


# A checkpoint as llm-compressor writes it --------------------------------------------------------
def _llm_compressor_checkpoint(folder, ids) -> None:
    """BERT quantized by compressed-tensors' own API, the calls llm-compressor makes: static
    minmax scales (weights amax / 127.5 per channel, so codes reach -128), int8 activations
    with zero points, the pooler ignored; compressed and saved with save_pretrained."""
    model = _float_model("bert")
    args = {"num_bits": 8, "type": "int", "dynamic": False}
    qc = QuantizationConfig.model_validate(
        {
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**args, "strategy": "channel", "symmetric": True},
                    "input_activations": {**args, "strategy": "tensor", "symmetric": False},
                }
            },
            "ignore": ["pooler.dense"],
        }
    )
    apply_quantization_config(model, qc)
    ranges, hooks = {}, []
    for name, mod in model.named_modules():
        if hasattr(mod, "input_scale"):
            mod.quantization_enabled = False
            hooks.append(
                mod.register_forward_pre_hook(
                    lambda m, a, name=name: ranges.__setitem__(name, (a[0].min(), a[0].max()))
                )
            )
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for name, mod in model.named_modules():
        if name in ranges:
            w = mod.weight.detach()
            s, _ = calculate_qparams(
                w.amin(1, keepdim=True), w.amax(1, keepdim=True), mod.quantization_scheme.weights
            )
            mod.weight_scale.data.copy_(s)
            s, z = calculate_qparams(*ranges[name], mod.quantization_scheme.input_activations)
            mod.input_scale.data.copy_(s)
            mod.input_zero_point.data.copy_(z)
            mod.quantization_enabled = True
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def test_llm_compressor_checkpoint_runs_on_qfuse_kernels(tmp_path):
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    folder = str(tmp_path / "llmc")
    _llm_compressor_checkpoint(folder, ids)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert any(
        (t == -128).any()
        for k, t in tensors.items()
        if k.endswith(".weight") and t.dtype == torch.int8
    )
    back = qfuse.load_compressed_tensors(folder, (ids,))
    rows = {r["name"]: r for r in qfuse.summary(back).rows}
    assert rows["pooler.dense"]["precision"] == "float"  # ignored by the checkpoint
    qkv = back.get_submodule("encoder.layer.0.attention.self.query_key_value")
    file_qkv = torch.cat(
        [tensors[f"encoder.layer.0.attention.self.{m}.weight"] for m in ("query", "key", "value")]
    )
    assert torch.equal(qkv.weight, file_qkv) and qkv.x_zero_point is not None
    hf = transformers.AutoModel.from_pretrained(folder)
    with torch.no_grad():
        want, got = hf(ids).last_hidden_state, back(ids)["last_hidden_state"]
    assert ((got - want).abs().max() / want.abs().max()).item() <= BOUND["int8_asym"]


@pytest.mark.parametrize(
    "preset, named",
    [
        ("W4A16", "W4A16: weights int4 group(128)"),
        ("FP8_BLOCK", "W8A8: weights fp8 block([128, 128])"),
        ("W8A16", "W8A16: weights int8 group(128), input activations none"),
    ],
)
def test_schemes_qfuse_cannot_run_are_named(tmp_path, preset, named):
    scheme = preset_name_to_scheme(preset, ["Linear"])
    qc = QuantizationConfig(config_groups={"group_0": scheme}).model_dump()
    qc["quant_method"] = "compressed-tensors"
    tmp_path.joinpath("config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "quantization_config": qc})
    )
    with pytest.raises(UnsupportedError, match=f"group_0.*{re.escape(named)}.*W8A8 only"):
        qfuse.load_compressed_tensors(tmp_path, (torch.zeros(1, 4, dtype=torch.long),))


def test_kv_cache_quantization_is_refused(tmp_path):
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])  # runs on qfuse; the KV cache not
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="float-quantized",
        kv_cache_scheme={"num_bits": 8, "type": "float"},
    ).model_dump()
    tmp_path.joinpath("config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(UnsupportedError, match="KV cache"):
        qfuse.load_compressed_tensors(tmp_path, (torch.zeros(1, 4, dtype=torch.long),))


# What the format cannot express, and atomic writes -------------------------------------------
def _old_folder(path) -> None:
    path.mkdir()
    path.joinpath("config.json").write_text("{}")


def _left_intact(path) -> bool:
    siblings = [p.name for p in path.parent.iterdir() if p.name != path.name]
    return [p.name for p in path.iterdir()] == ["config.json"] and not [
        s for s in siblings if s.startswith(f".{path.name}.")
    ]


def test_a_smoothquant_prologue_is_refused_before_writing(tmp_path, tmp_path_factory):
    import copy

    case = _get_case("bert", "int8_static", tmp_path_factory)
    qmodel = copy.deepcopy(case.qmodel)
    layer = qmodel.get_submodule("encoder.layer.0.attention.output.dense")
    layer.x_inv_scale = torch.ones(layer.in_features)  # what SmoothQuant leaves in a prologue
    _old_folder(tmp_path / "out")
    with pytest.raises(UnsupportedError, match="attention.output.dense.*SmoothQuant"):
        qfuse.export_compressed_tensors(qmodel, tmp_path / "out")
    assert _left_intact(tmp_path / "out")


def test_a_failed_write_leaves_the_old_folder(tmp_path, tmp_path_factory):
    class BrokenTokenizer:
        def save_pretrained(self, folder):
            open(os.path.join(folder, "tokenizer.json"), "w").close()
            raise OSError("disk full")

    case = _get_case("bert", "int8_static", tmp_path_factory)
    _old_folder(tmp_path / "out")
    with pytest.raises(OSError, match="disk full"):
        qfuse.export_compressed_tensors(case.qmodel, tmp_path / "out", tokenizer=BrokenTokenizer())
    assert _left_intact(tmp_path / "out")


def test_models_the_format_cannot_hold_are_refused(tmp_path):
    from tests.models import MLPBlock

    x = torch.randn(4, 32)
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    with pytest.raises(QFuseError, match="qfuse.convert"):
        qfuse.export_compressed_tensors(prepared, tmp_path / "a")
    with pytest.raises(UnsupportedError, match="no transformers config"):
        qfuse.export_compressed_tensors(qfuse.convert(prepared), tmp_path / "b")
    assert not list(tmp_path.iterdir())


def test_folders_that_are_not_compressed_tensors_checkpoints_are_refused(tmp_path):
    ids = (torch.zeros(1, 4, dtype=torch.long),)
    with pytest.raises(FormatError, match="not a model folder"):
        qfuse.load_compressed_tensors(tmp_path, ids)
    tmp_path.joinpath("config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(FormatError, match="no quantization_config"):
        qfuse.load_compressed_tensors(tmp_path, ids)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="'gptq', not 'compressed-tensors'"):
        qfuse.load_compressed_tensors(tmp_path, ids)
