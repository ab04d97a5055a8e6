"""Sequential (block by block) calibration equals whole-model calibration bit for bit on the CPU:
observer statistics, Hessians, scales and GPTQ weights; and it resumes from its checkpoints."""

import copy

import pytest
import torch

import qfuse
from qfuse.calibrate import sequential
from qfuse.calibrate.stages import find_blocks, split_stages
from qfuse.errors import CalibrationError, FormatError, UnsupportedError
from qfuse.observers.base import Recorder
from qfuse.state import get_state


@pytest.fixture(scope="module")
def calibrated(llama):
    """The prepared Llama, its batches, and a copy calibrated whole (``prepared(batch)``)."""
    prepared, batches = llama
    whole = copy.deepcopy(prepared)
    with torch.no_grad():
        for b in batches:
            whole(**b)
    return prepared, batches, whole


def _recorders(gm) -> dict:
    return {
        f"{name}.{k}": v.clone()
        for name, m in gm.named_modules()
        if isinstance(m, Recorder)
        for k, v in m.state_dict().items()
    }


def _converted(gm) -> dict:
    return {k: v.clone() for k, v in qfuse.convert(gm).state_dict().items()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_stages_are_prefix_layers_tail(calibrated):
    prepared = calibrated[0]
    assert find_blocks(prepared) == "model.layers"
    stages = split_stages(prepared, get_state(prepared).chains)
    assert [s.name for s in stages] == ["prefix", "model.layers.0", "model.layers.1", "tail"]
    # Q/K/V merged, O, gate/up merged, down in each layer; lm_head in the tail
    assert [len(s.chains) for s in stages] == [0, 4, 4, 1]
    # layer 1 reads what layer 0 (its residual stream) and the prefix (rotary tables) wrote
    written = set(stages[0].outputs) | set(stages[1].outputs)
    assert set(stages[2].inputs) <= written
    assert set(stages[2].inputs) & set(stages[1].outputs)


def test_sequential_equals_whole_model_bit_for_bit(calibrated, monkeypatch):
    prepared, batches, whole = calibrated
    seq = qfuse.calibrate_sequential(copy.deepcopy(prepared), batches, device="cpu")
    _assert_equal(_recorders(seq), _recorders(whole))
    # convert takes the GPTQ results the blocks cached: it never rounds again
    want = _converted(whole)

    def no_rounding(*args, **kwargs):
        raise AssertionError("convert re-ran GPTQ instead of taking the cached result")

    monkeypatch.setattr("qfuse.algorithms.gptq.gptq_round", no_rounding)
    got = _converted(seq)
    _assert_equal(got, want)
    assert sum(k.endswith("weight_scale") for k in want) >= 9


def test_resume_after_an_interruption(calibrated, tmp_path, monkeypatch):
    prepared, batches, whole = calibrated
    rounded = []
    real = sequential._round_stage

    def interrupted(prepared, stage, group):
        if stage.name == "model.layers.1":
            raise KeyboardInterrupt
        rounded.append(stage.name)
        return real(prepared, stage, group)

    monkeypatch.setattr(sequential, "_round_stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qfuse.calibrate_sequential(
            copy.deepcopy(prepared), batches, device="cpu", checkpoint_dir=str(tmp_path)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json",
        "stage-000.pt",
        "stage-001.pt",
    ]

    def counting(prepared, stage, group):
        rounded.append(stage.name)
        return real(prepared, stage, group)

    monkeypatch.setattr(sequential, "_round_stage", counting)
    resumed = qfuse.calibrate_sequential(
        copy.deepcopy(prepared), batches, device="cpu", checkpoint_dir=str(tmp_path)
    )
    assert rounded == ["prefix", "model.layers.0", "model.layers.1", "tail"]  # 0 not redone
    monkeypatch.setattr(sequential, "_round_stage", real)
    _assert_equal(_converted(resumed), _converted(whole))
    with pytest.raises(FormatError, match="batches"):  # another run in the same directory
        qfuse.calibrate_sequential(
            copy.deepcopy(prepared), batches[:2], device="cpu", checkpoint_dir=str(tmp_path)
        )


def test_unknown_blocks_name_the_containers(calibrated):
    with pytest.raises(UnsupportedError, match=r"blocks='model.decoder'.*model.layers"):
        qfuse.calibrate_sequential(
            copy.deepcopy(calibrated[0]), calibrated[1], device="cpu", blocks="model.decoder"
        )


def test_quantized_outputs_feed_the_next_block_what_it_will_see(calibrated):
    prepared, batches, whole = calibrated
    seq = qfuse.calibrate_sequential(
        copy.deepcopy(prepared), batches, device="cpu", outputs="quantized"
    )
    got, want = _recorders(seq), _recorders(whole)
    stages = split_stages(prepared, get_state(prepared).chains)
    layer0 = tuple(f"{r}." for r in stages[1].recorders)  # layer 0 reads float inputs
    first = [k for k in want if k.startswith(layer0)]
    later = [k for k in want if k.endswith("max_val") and not k.startswith(layer0)]
    assert first and later
    for key in first:
        assert torch.equal(got[key], want[key]), key
    # later blocks read the quantized blocks' outputs: other ranges, close to the float ones
    assert any(not torch.equal(got[k], want[k]) for k in later)
    for key in later:
        torch.testing.assert_close(got[key], want[key], rtol=0.25, atol=0.05)
    qfuse.convert(seq)


def test_outputs_must_be_float_or_quantized(calibrated):
    with pytest.raises(UnsupportedError, match="outputs='int8'"):
        qfuse.calibrate_sequential(copy.deepcopy(calibrated[0]), calibrated[1], outputs="int8")


def test_a_batch_with_other_inputs_is_an_error(calibrated):
    prepared, batches, _ = calibrated
    extra = {**batches[0], "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    with pytest.raises(CalibrationError, match="does not match the inputs"):
        qfuse.calibrate_sequential(copy.deepcopy(prepared), [extra], device="cpu")


def test_a_model_without_repeated_blocks_is_an_error():
    x = torch.randn(2, 4)

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    prepared = qfuse.prepare(Wrapper().eval(), qfuse.QConfig.int8_static(), (x,))
    with pytest.raises(UnsupportedError, match="no repeated blocks"):
        qfuse.calibrate_sequential(prepared, [x], device="cpu")
