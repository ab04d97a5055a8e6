"""The Observer contract, checked for every registered observer (qfuse/observers/__init__.py)."""

import math

import pytest
import torch

from qfuse.errors import CalibrationError, UnsupportedError
from qfuse.observers import OBSERVER_REGISTRY, make_observer
from tests.observers.parity import CHANNEL_AXIS, make_batches

NAMES = sorted(OBSERVER_REGISTRY)
HISTOGRAMS = [n for n in NAMES if n.startswith("histogram")]
PER_CHANNEL = [n for n in NAMES if n not in HISTOGRAMS]
LAYER = "encoder.layer.3.mlp.fc1"
schemes = pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])


def test_registry_names():
    assert set(NAMES) == {
        "minmax",
        "moving_average_minmax",
        "percentile",
        "histogram",
        "histogram_mse",
        "histogram_entropy",
    }


def test_unknown_name_lists_the_choices():
    with pytest.raises(UnsupportedError, match="histogram_entropy"):
        make_observer("kl")


@pytest.mark.parametrize("name", NAMES)
def test_forward_is_identity_and_counts_batches(name):
    obs = make_observer(name)
    x = make_batches("gaussian")[0]
    assert obs(x) is x
    assert int(obs.num_batches) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_batch_names_the_layer(name, bad):
    obs = make_observer(name, layer_name=LAYER)
    obs(torch.randn(64))
    x = torch.randn(64)
    x[5] = bad
    kind = "NaN" if math.isnan(bad) else "Inf"
    with pytest.raises(CalibrationError, match=rf"{LAYER}: calibration batch 2 contains {kind}"):
        obs(x)


@schemes
@pytest.mark.parametrize("name", NAMES)
def test_all_zero_range_raises(name, symmetric):
    obs = make_observer(name, symmetric=symmetric, layer_name=LAYER)
    obs(torch.zeros(3, 5))
    obs(torch.zeros(7))
    with pytest.raises(CalibrationError, match=rf"{LAYER}: every calibration value was exactly 0"):
        obs.calculate_qparams()


@pytest.mark.parametrize("name", NAMES)
def test_qparams_before_data_raise(name):
    obs = make_observer(name, layer_name=LAYER)
    with pytest.raises(CalibrationError, match=rf"{LAYER}: no calibration data"):
        obs.calculate_qparams()


@schemes
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_calibration(name, symmetric):
    batches = make_batches("outliers")
    saved = make_observer(name, symmetric=symmetric)
    for x in batches[:2]:
        saved(x)
    loaded = make_observer(name, symmetric=symmetric)
    loaded.load_state_dict(saved.state_dict())
    assert int(loaded.num_batches) == 2
    for obs in (saved, loaded):
        for x in batches[2:]:
            obs(x)
    (scale, zp), (ref_scale, ref_zp) = loaded.calculate_qparams(), saved.calculate_qparams()
    assert torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)


@pytest.mark.parametrize("name", PER_CHANNEL)
def test_per_channel_state_dict_loads_into_fresh_observer(name):
    saved = make_observer(name, channel_axis=CHANNEL_AXIS)
    saved(make_batches("gaussian")[0])
    loaded = make_observer(name, channel_axis=CHANNEL_AXIS)
    loaded.load_state_dict(saved.state_dict())
    assert torch.equal(loaded.calculate_qparams()[0], saved.calculate_qparams()[0])


@pytest.mark.parametrize("name", HISTOGRAMS)
def test_histogram_observers_refuse_per_channel(name):
    with pytest.raises(UnsupportedError, match=rf"{LAYER}: histogram observers are per-tensor"):
        make_observer(name, channel_axis=0, layer_name=LAYER)


@pytest.mark.parametrize("name", ["minmax", "moving_average_minmax", "percentile"])
def test_channel_count_change_between_batches_is_an_error(name):
    obs = make_observer(name, channel_axis=0, layer_name="enc.fc (input)")
    obs(torch.randn(4, 8))
    with pytest.raises(CalibrationError, match=r"enc.fc \(input\).*1 channels"):
        obs(torch.randn(1, 8))


@pytest.mark.parametrize("name", sorted(OBSERVER_REGISTRY))
def test_empty_batch_is_skipped(name):
    obs = make_observer(name)
    obs(torch.empty(0, 4))
    assert int(obs.num_batches) == 0
