import pytest
import torch
from torch import nn

import qfuse
from qfuse.routing import CostModel, DeviceRates, analytic_us


def prepared_model():
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).eval()
    return qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 4096),))


def test_analytic_model_favours_int8_for_big_and_float_for_tiny_gemms():
    r = DeviceRates()
    assert analytic_us("int8", 4096, 4096, 14336, r) < 0.7 * analytic_us(
        "bf16", 4096, 4096, 14336, r
    )
    assert analytic_us("int8", 1, 128, 10, r) > analytic_us("bf16", 1, 128, 10, r)
    with pytest.raises(qfuse.QFuseError, match="unknown implementation"):
        analytic_us("int4", 1, 1, 1, r)


def test_route_keeps_the_tiny_head_float_and_convert_honours_it():
    prepared = prepared_model()
    keep = qfuse.route(prepared, tokens=16)
    assert list(keep) == ["2"] and "bf16 predicted faster" in keep["2"]
    prepared(torch.randn(4, 4096))
    rows = {r["name"]: r for r in qfuse.summary(qfuse.convert(prepared, keep_float=keep)).rows}
    assert rows["0"]["precision"] == "int8" and rows["2"]["precision"] == "float"


def test_measured_timings_override_the_analytic_model(tmp_path, monkeypatch):
    monkeypatch.setenv("QFUSE_CACHE", str(tmp_path))
    model = CostModel(measured={"int8:16x4096x10": 1.0, "bf16:16x4096x10": 9.0})
    assert model.predict_us("int8", 16, 4096, 10) == (1.0, "measured")
    assert qfuse.route(prepared_model(), tokens=16, cost_model=model) == {}
    path = model.save("Fake GPU")
    assert path.name == "costs-Fake_GPU.json"
    assert CostModel.load("Fake GPU").measured == model.measured


def test_measure_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(qfuse.QFuseError, match="CUDA"):
        CostModel().measure([(16, 64, 64)])
