import pytest
import torch
from torch import nn

import qfuse
from qfuse.observers import MinMaxObserver
from tests.models import MLPBlock


def test_shared_input_gets_one_observer():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.q(x) + self.k(x) * self.v(x)

    x = (torch.randn(2, 16),)
    prepared = qfuse.prepare(QKV().eval(), qfuse.QConfig.int8_static(), x, merge_siblings=False)
    observers = [m for m in prepared.modules() if isinstance(m, MinMaxObserver)]
    assert len(observers) == 1
    assert "q, k, v" in observers[0].layer_name
    # Merged (the default), k and v are one layer; q absorbed the add as its residual.
    prepared = qfuse.prepare(QKV().eval(), qfuse.QConfig.int8_static(), x)
    (observer,) = [m for m in prepared.modules() if isinstance(m, MinMaxObserver)]
    assert observer.layer_name == "q, k_v (input)"


def test_prepare_leaves_float_model_untouched_and_outputs_equal():
    model = MLPBlock().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 32)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    assert torch.equal(prepared(x), model(x))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_untraceable_model_raises_capture_error():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # control flow on a tensor value
                return self.fc(x)
            return x

    with pytest.raises(qfuse.CaptureError, match="DataDependent"):
        qfuse.prepare(DataDependent(), qfuse.QConfig.int8_static(), (torch.randn(2, 4),))


def test_unsupported_input_dtype_is_reported_not_quantized():
    model = nn.Sequential(nn.Linear(4, 4)).double().eval()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 4).double(),))
    rows = qfuse.summary(prepared).rows
    assert rows[0]["precision"] == "float" and "float64" in rows[0]["note"]


def test_non_qconfig_is_rejected():
    with pytest.raises(qfuse.UnsupportedError, match="QConfig"):
        qfuse.prepare(MLPBlock(), {"dtype": "int8"}, (torch.randn(2, 32),))


def test_layer_configs_choose_the_observer_scheme_per_layer():
    cfg = qfuse.QConfig.int8_static()
    prepared = qfuse.prepare(
        MLPBlock().eval(),
        cfg,
        (torch.randn(2, 32),),
        layer_configs={"do*": qfuse.QConfig(symmetric=False)},
    )
    observers = {m.layer_name: m for m in prepared.modules() if isinstance(m, MinMaxObserver)}
    assert observers["up (input)"].symmetric and not observers["down (input)"].symmetric


def test_layer_configs_cannot_change_dtype():
    with pytest.raises(qfuse.UnsupportedError, match="layer_configs"):
        qfuse.prepare(
            MLPBlock().eval(),
            qfuse.QConfig.int8_static(),
            (torch.randn(2, 32),),
            layer_configs={"up": qfuse.QConfig(weight_granularity=qfuse.PerTensor())},
        )
