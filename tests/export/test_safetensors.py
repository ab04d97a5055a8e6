"""qfuse.save / qfuse.load: bit-exact round trips, the file as plain safetensors, bad input."""

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import qfuse
import qfuse.export.safetensors as qsafetensors
from qfuse.export.format import FORMAT_VERSION, METADATA_KEY
from qfuse.export.tensors import graph_tensors
from qfuse.nn import QLinear
from qfuse.state import get_state
from tests.export.cases import (
    CONFIGS,
    MINILM_CONFIGS,
    SMALL,
    TinyEncoder,
    assert_same,
    expected_leaves,
    quantize,
)
from tests.models import MLPBlock


def _save(case, tmp_path, name="model.safetensors"):
    path = tmp_path / name
    qfuse.save(case.qmodel, path)
    return path


def _load(case, path, seed=123, **kw):
    return qfuse.load(path, case.make_float(seed), case.args, case.kwargs, **kw)


def _rewrite(path, out, *, tensors=None, meta_edit=None):
    """Write ``path``'s tensors/metadata to ``out`` after edits (a hand-made 'other' file)."""
    with safetensors.safe_open(path, framework="pt") as f:
        raw = f.metadata()
        loaded = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(raw[METADATA_KEY])
    if meta_edit:
        meta_edit(meta)
    safetensors.torch.save_file(tensors or loaded, out, metadata={METADATA_KEY: json.dumps(meta)})
    return out


# Round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", SMALL)
def test_round_trip_is_bit_identical(make_case, tmp_path, name, config):
    case = make_case(name, config)
    path = _save(case, tmp_path)
    # Seed 123: the float model's own weights are random and differ from the saved model's, so
    # identical outputs prove every tensor the model uses came from the file.
    loaded = _load(case, path)
    assert_same(case.expected(), expected_leaves(loaded, case.runs()))
    assert qfuse.summary(loaded).rows == qfuse.summary(case.qmodel).rows
    assert get_state(loaded).config == config


@pytest.mark.parametrize("config", MINILM_CONFIGS)
def test_minilm_round_trip_is_bit_identical(make_case, tmp_path, config):
    case = make_case("minilm", config)
    path = _save(case, tmp_path)
    loaded = _load(case, path)  # a randomly initialised BertModel of the same config
    assert_same(case.expected(), expected_leaves(loaded, case.runs()))
    rows = qfuse.summary(loaded).rows
    assert rows == qfuse.summary(case.qmodel).rows
    assert {"Linear→GELU", "Linear→residual"} <= {r["pattern"] for r in rows}


def test_keep_float_layers_travel_as_float(make_case, tmp_path):
    case = make_case("embed", qfuse.QConfig.int8_static())
    qmodel = quantize(case, case.config, keep_float={"fc2": "sensitive"})
    path = tmp_path / "mixed.safetensors"
    qfuse.save(qmodel, path)
    assert safetensors.torch.load_file(path)["fc2.weight"].dtype == torch.float32
    loaded = _load(case, path)
    assert not isinstance(loaded.get_submodule("fc2"), QLinear)
    assert_same(expected_leaves(qmodel, case.runs()), expected_leaves(loaded, case.runs()))
    kept = [r for r in qfuse.summary(loaded).rows if r["name"] == "fc2"]
    assert kept and kept[0]["note"] == "kept float: sensitive"


def test_tied_weight_is_saved_once(make_case, tmp_path):
    case = make_case("embed", qfuse.QConfig.int8_static())
    names = set(safetensors.torch.load_file(_save(case, tmp_path)))
    # export reads the tied embedding/head weight through one name; the other is dropped.
    assert len(names & {"embed.weight", "head.weight"}) == 1


def test_load_leaves_the_float_model_untouched(make_case, tmp_path):
    case = make_case("embed", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    float_model = case.make_float(123)
    before = {k: v.clone() for k, v in float_model.state_dict().items()}
    loaded = qfuse.load(path, float_model, case.args)
    after = float_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loaded.get_submodule("norm").weight is not float_model.norm.weight


def test_file_is_plain_safetensors_with_documented_names(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static_asymmetric())
    path = _save(case, tmp_path)
    tensors = safetensors.torch.load_file(path)
    assert set(tensors) == set(graph_tensors(case.qmodel))
    up = case.qmodel.get_submodule("up")
    assert tensors["up.weight"].dtype == torch.int8
    for buf in ("weight", "scale", "bias", "x_scale", "x_zero_point", "out_scale"):
        assert torch.equal(tensors[f"up.{buf}"], getattr(up, buf)), buf
    assert "up.weight_sum" not in tensors  # folded into the bias (format 2)
    with safetensors.safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["qfuse_version"] == qfuse.__version__
    assert meta["config"] == case.config.to_dict()
    by_name = {entry["name"]: entry for entry in meta["layers"]}
    assert by_name["up"]["pattern"] == "Linear→GELU"
    assert by_name["up"]["precision"] == "int8"
    assert by_name["up"]["kernel"] == "torch reference (cpu)"
    assert by_name["up"]["layout"] == up.layout()
    assert by_name["down"]["input"] == "int8 from up"


def test_load_maps_tensors_to_the_requested_device(make_case, tmp_path):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    loaded = _load(case, _save(case, tmp_path), device="cpu")
    assert {t.device.type for t in graph_tensors(loaded).values()} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.parametrize("saved_on, loaded_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_file_moves_between_cpu_and_cuda(make_case, tmp_path, saved_on, loaded_on):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = tmp_path / "m.safetensors"
    # A fresh copy per device (copy.deepcopy of a GraphModule drops the qfuse state).
    qfuse.save(quantize(case, case.config).to(saved_on), path)
    loaded = _load(case, path, device=loaded_on)
    assert {t.device.type for t in graph_tensors(loaded).values()} == {loaded_on}
    reference = quantize(case, case.config).to(loaded_on)
    x = case.args[0].to(loaded_on)
    assert torch.equal(loaded(x), reference(x))
    assert qfuse.summary(loaded).rows == qfuse.summary(reference).rows


# Atomic write ----------------------------------------------------------------------------------
def test_failed_save_leaves_the_previous_file_and_no_temp_file(make_case, tmp_path, monkeypatch):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"previous version")

    def dies_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qsafetensors, "save_file", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        qfuse.save(case.qmodel, path)
    assert path.read_bytes() == b"previous version"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_save_replaces_an_existing_file(make_case, tmp_path):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"previous version")
    qfuse.save(case.qmodel, path)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert safetensors.torch.load_file(path)["conv1.weight"].dtype == torch.int8


def test_save_rejects_a_model_that_is_not_converted(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    prepared = qfuse.prepare(case.make_float(0), case.config, case.args)
    with pytest.raises(qfuse.QFuseError, match="prepared .*qfuse.convert"):
        qfuse.save(prepared, tmp_path / "m.safetensors")
    assert not os.listdir(tmp_path)


# Bad files -------------------------------------------------------------------------------------
def test_truncated_file_is_a_format_error(make_case, tmp_path):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 64])
    with pytest.raises(qfuse.FormatError, match="truncated or corrupted"):
        _load(case, path)


def test_flipped_data_byte_names_the_tensor(make_case, tmp_path):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the data section, i.e. of the last tensor stored
    path.write_bytes(bytes(data))
    with pytest.raises(qfuse.FormatError, match=r"tensor \S+ fails its checksum"):
        _load(case, path)


def test_garbage_header_is_a_format_error(make_case, tmp_path):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    data = bytearray(path.read_bytes())
    data[8:16] = b"}}}}}}}}"
    path.write_bytes(bytes(data))
    with pytest.raises(qfuse.FormatError, match="truncated or corrupted"):
        _load(case, path)


def test_plain_safetensors_file_is_not_a_qfuse_file(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(qfuse.FormatError, match="not written by qfuse.save"):
        _load(case, path)


def test_newer_format_version_asks_for_an_upgrade(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    newer = _rewrite(
        _save(case, tmp_path),
        tmp_path / "newer.safetensors",
        meta_edit=lambda m: m.update(format_version=FORMAT_VERSION + 1, qfuse_version="9.0"),
    )
    with pytest.raises(qfuse.FormatError, match=f"version {FORMAT_VERSION + 1}.*Upgrade qfuse"):
        _load(case, newer)


def test_tensor_missing_from_the_file_is_named(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    tensors = safetensors.torch.load_file(path)
    del tensors["down.scale"]
    out = _rewrite(path, tmp_path / "cut.safetensors", tensors=tensors)
    with pytest.raises(qfuse.FormatError, match="missing: down.scale"):
        _load(case, out)


# Float model that does not match -----------------------------------------------------------------
class RenamedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.proj = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x):
        return self.proj(self.act(self.up(x))) + x


def test_missing_and_extra_layers_are_named(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    with pytest.raises(qfuse.FormatError, match="not in the model: down;.*not in the file: proj"):
        qfuse.load(path, RenamedMLP().eval(), case.args)


def test_different_layer_size_names_the_weight(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    with pytest.raises(qfuse.FormatError, match=r"tensor up.weight has shape \(64, 32\)"):
        qfuse.load(path, MLPBlock(h=48).eval(), case.args)


def test_different_activation_names_the_layer(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    with pytest.raises(qfuse.FormatError, match="layer up: .*Linear→GELU.*Linear→GELU\\(tanh\\)"):
        qfuse.load(path, MLPBlock(approximate="tanh").eval(), case.args)


def test_float_tensor_shape_mismatch_names_the_tensor(make_case, tmp_path):
    case = make_case("embed", qfuse.QConfig.int8_static())
    path = _save(case, tmp_path)
    with pytest.raises(qfuse.FormatError, match=r"tensor head.weight has shape \(50, 16\)"):
        qfuse.load(path, TinyEncoder(vocab=60).eval(), case.args)


def test_float_dtype_mismatch_names_the_tensor_and_the_cast(make_case, tmp_path):
    case = make_case("embed", qfuse.QConfig.int8_static())
    bf16 = TinyEncoder().eval().to(torch.bfloat16)
    prepared = qfuse.prepare(bf16, case.config, case.args)
    prepared(*case.args)
    path = tmp_path / "bf16.safetensors"
    qfuse.save(qfuse.convert(prepared), path)
    with pytest.raises(qfuse.FormatError, match=r"head.weight is bfloat16 .*to\(torch.bfloat16\)"):
        qfuse.load(path, TinyEncoder().eval(), case.args)
    loaded = qfuse.load(path, TinyEncoder().eval().to(torch.bfloat16), case.args)
    assert loaded(*case.args).dtype == torch.bfloat16
