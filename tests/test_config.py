import pytest
import torch

import qfuse
from qfuse.config import PerChannel, PerTensor, PerToken, QConfig


def test_int8_static_preset():
    cfg = QConfig.int8_static()
    assert cfg.dtype == torch.int8 and cfg.symmetric and cfg.observer == "minmax"
    assert cfg.weight_granularity == PerChannel(0) and cfg.activation_granularity == PerTensor()
    assert not cfg.is_dynamic


def test_dict_round_trip_and_version():
    cfg = QConfig(symmetric=False, weight_granularity=PerTensor())
    data = cfg.to_dict()
    assert data["version"] == 1 and data["dtype"] == "int8"
    assert QConfig.from_dict(data) == cfg


def test_newer_version_is_refused():
    data = QConfig().to_dict()
    data["version"] = 99
    with pytest.raises(qfuse.UnsupportedError, match="newer"):
        QConfig.from_dict(data)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=torch.int16), "not supported"),
        (dict(weight_granularity=PerToken()), "weight_granularity"),
        (dict(weight_granularity=PerChannel(1)), "axis=0"),
        (dict(observer="nope"), "unknown"),
        (dict(dtype=torch.float8_e4m3fn, symmetric=False), "symmetric"),
    ],
)
def test_invalid_configs_raise_typed_errors(kwargs, match):
    with pytest.raises(qfuse.UnsupportedError, match=match):
        QConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        QConfig().symmetric = False
