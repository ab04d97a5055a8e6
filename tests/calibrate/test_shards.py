"""Sequential calibration of a model on ``meta`` from safetensors shards (``weights=``) equals the
fully loaded sequential calibration bit for bit, holds one stage's float weights at a time, resumes,
and rejects a checkpoint that does not match the prepared graph."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import qfuse
from qfuse.calibrate import sequential
from qfuse.errors import CalibrationError, WeightsError
from tests.calibrate.conftest import by_chain


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_shards_equal_the_loaded_model_one_stage_in_memory(shards, monkeypatch):
    folder, meta, batches, loaded = shards
    assert len(list(folder.glob("*.safetensors"))) >= 2
    prepared = copy.deepcopy(meta)
    assert all(p.is_meta for p in prepared.parameters())
    real = sequential._run
    held = []

    def watched(module, stage, *args):
        # float weights in memory now: this stage's, nothing of any other stage
        resident = {
            n for n, p in prepared.named_parameters(remove_duplicate=False) if not p.is_meta
        }
        assert resident <= set(stage.params), resident - set(stage.params)
        held.append((stage.name, len(resident)))
        return real(module, stage, *args)

    monkeypatch.setattr(sequential, "_run", watched)
    qfuse.calibrate_sequential(prepared, batches, device="cpu", weights=str(folder))
    assert [n for n, k in held] == ["prefix", "model.layers.0", "model.layers.1", "tail"]
    assert all(k > 0 for _, k in held)
    _assert_equal(by_chain(prepared), by_chain(loaded))
    assert not any(p.is_meta for p in prepared.parameters())  # back on the CPU for convert

    def no_rounding(*args, **kwargs):
        raise AssertionError("convert re-ran GPTQ instead of taking the cached result")

    monkeypatch.setattr("qfuse.algorithms.gptq.gptq_round", no_rounding)
    got, want = qfuse.convert(prepared), qfuse.convert(loaded)
    _assert_equal(got.state_dict(), want.state_dict())
    x = {"input_ids": torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(5))}
    assert torch.equal(got(**x)["logits"], want(**x)["logits"])


def test_resume_from_a_checkpoint_with_shards(shards, tmp_path, monkeypatch):
    folder, meta, batches, loaded = shards
    index = str(folder / "model.safetensors.index.json")
    real = sequential._round_stage

    def interrupted(prepared, stage, group):
        if stage.name == "model.layers.1":
            raise KeyboardInterrupt
        return real(prepared, stage, group)

    monkeypatch.setattr(sequential, "_round_stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qfuse.calibrate_sequential(
            copy.deepcopy(meta), batches, device="cpu", weights=index, checkpoint_dir=str(tmp_path)
        )
    rounded = []

    def counting(prepared, stage, group):
        rounded.append(stage.name)
        return real(prepared, stage, group)

    monkeypatch.setattr(sequential, "_round_stage", counting)
    resumed = qfuse.calibrate_sequential(
        copy.deepcopy(meta), batches, device="cpu", weights=index, checkpoint_dir=str(tmp_path)
    )
    assert rounded == ["model.layers.1", "tail"]
    # the checkpoints keep no Hessians (save_hessians=False); everything else is the same
    got, want = by_chain(resumed), by_chain(loaded)
    for key in [k for k in want if k.endswith("hessian.hessian")]:
        del got[key], want[key]
    _assert_equal(got, want)


def _edited(folder, tmp_path, edit) -> str:
    """The checkpoint as one .safetensors file, after ``edit(tensors)``."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in set(index["weight_map"].values()):
        tensors.update(load_file(folder / name))
    edit(tensors)
    path = str(tmp_path / "edited.safetensors")
    save_file(tensors, path)
    return path


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("model.norm.weight"), r"model\.norm\.weight is on meta and not in"),
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            r"q_proj_k_proj_v_proj\.weight \(merged from .*k_proj\.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 64)}),
            r"down_proj\.weight in .*edited\.safetensors has shape \[64, 64\].* needs \[64, 128\]",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64).half()}),
            r"up_proj\.weight in .*edited\.safetensors is F16 .*gate_proj_up_proj\.weight",
        ),
    ],
    ids=["missing", "missing-member", "shape", "dtype"],
)
def test_a_checkpoint_that_does_not_match_names_the_tensor_and_file(shards, tmp_path, edit, match):
    folder, meta, batches, _ = shards
    path = _edited(folder, tmp_path, edit)
    with pytest.raises(WeightsError, match=match):
        qfuse.calibrate_sequential(copy.deepcopy(meta), batches, device="cpu", weights=path)


def test_weights_that_match_nothing_are_errors(shards, llama, tmp_path):
    folder, meta, batches, _ = shards
    for path, match in [
        (tmp_path / "nowhere", "does not exist"),
        (tmp_path, "without .safetensors files"),
        (folder / "config.json", "not a safetensors index"),
    ]:
        with pytest.raises(WeightsError, match=match):
            qfuse.calibrate_sequential(copy.deepcopy(meta), batches, weights=str(path))
    with pytest.raises(WeightsError, match="no tensor of the prepared model is on meta"):
        qfuse.calibrate_sequential(copy.deepcopy(llama[0]), batches, weights=str(folder))
    with pytest.raises(CalibrationError, match="is on meta .*pass weights="):
        qfuse.calibrate_sequential(copy.deepcopy(meta), batches, device="cpu")


def test_a_buffer_left_on_meta_points_to_init_empty_weights(shards):
    folder, meta, batches, _ = shards
    prepared = copy.deepcopy(meta)  # as if built under torch.device("meta")
    rotary = prepared.get_submodule("model.rotary_emb")
    rotary._buffers["inv_freq"] = torch.empty_like(rotary.inv_freq, device="meta")
    with pytest.raises(WeightsError, match=r"inv_freq .*init_empty_weights"):
        qfuse.calibrate_sequential(prepared, batches, weights=str(folder))
