import pytest
import torch
from torch import nn

import qfuse
from qfuse.analysis.routing import CostModel, DeviceRates, analytic_us

# The rates these tests reason with, stated here: retuning the shipped H200 defaults
# (routing.DeviceRates) must not break them, only a change in how routing uses rates may.
RATES = DeviceRates(bf16_tflops=694.0, int8_tops=1096.0, fp8_tflops=1272.0, hbm_tbps=3.0,
                    launch_us=2.0, host_us={"bf16": 7.0, "int8": 30.0, "fp8": 30.0},
                    separate_quant_from_m=128, tile={"bf16": 64, "int8": 64, "fp8": 64})
ANALYTIC = CostModel(RATES)  # no measurements: the roofline at those rates


def prepared_model(config=None, d=4096):
    model = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 10)).eval()
    return qfuse.prepare(model, config or qfuse.QConfig.int8_static(), (torch.randn(2, d),))


def test_analytic_model_favours_quantized_for_big_and_float_for_tiny_gemms():
    r = RATES
    big = (4096, 4096, 14336)
    assert analytic_us("int8", *big, r) < 0.7 * analytic_us("bf16", *big, r)
    assert analytic_us("fp8", *big, r) < analytic_us("int8", *big, r)  # 1272 vs 1096 T/s
    for impl in ("int8", "fp8"):
        assert analytic_us(impl, 1, 128, 10, r) > analytic_us("bf16", 1, 128, 10, r)
    with pytest.raises(qfuse.QFuseError, match="unknown implementation"):
        analytic_us("int4", 1, 1, 1, r)


def test_route_picks_per_layer_and_convert_records_why():
    prepared = prepared_model()
    plan = qfuse.route(prepared, tokens=8192, cost_model=ANALYTIC)
    assert plan.choices == {"0": "fp8", "2": "bf16"}  # big GEMM: fp8 fastest; 10-wide head: bf16
    assert "bf16 predicted fastest at M=8192" in plan.keep_float["2"]
    assert plan.layer_dtypes == {"0": torch.float8_e4m3fn}
    assert "0 " in str(plan) and "fp8" in str(plan)
    prepared(torch.randn(4, 4096))
    qmodel = qfuse.convert(prepared, **plan.convert_kwargs())
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["0"]["precision"] == "fp8_e4m3" and "route: fp8" in rows["0"]["note"]
    assert rows["2"]["precision"] == "float"


def test_candidates_and_margin_keep_the_config_dtype():
    prepared = prepared_model()
    only_int8 = qfuse.route(prepared, 8192, ANALYTIC, candidates=("int8", "bf16"))
    assert only_int8.choices["0"] == "int8"
    # fp8 is predicted ~1.15x faster than int8 here: a 1.3x margin keeps the config's int8.
    assert qfuse.route(prepared, 8192, ANALYTIC, margin=1.3).choices["0"] == "int8"
    fp8_model = prepared_model(qfuse.QConfig.fp8_static())
    assert qfuse.route(fp8_model, 8192, ANALYTIC).choices["0"] == "fp8"
    assert set(qfuse.route(prepared, 8192, ANALYTIC, candidates=("bf16",)).choices.values()) == {
        "bf16"
    }
    for bad in (("int8", "fp8"), ("int4", "bf16")):
        with pytest.raises(qfuse.QFuseError, match="candidates"):
            qfuse.route(prepared, 16, ANALYTIC, candidates=bad)


def test_measured_timings_override_the_analytic_model(tmp_path, monkeypatch):
    monkeypatch.setenv("QFUSE_CACHE_DIR", str(tmp_path))
    measured = {"int8:16x4096x10": 1.0, "fp8:16x4096x10": 2.0, "bf16:16x4096x10": 9.0}
    model = CostModel(measured=measured)
    assert model.predict_us("int8", 16, 4096, 10) == (1.0, "measured")
    plan = qfuse.route(prepared_model(), tokens=16, cost_model=model)
    assert plan.choices["2"] == "int8" and "(measured)" in plan.reason("2")
    path = model.save("Fake GPU")
    assert path.name == "costs-Fake_GPU.json"
    assert CostModel.load("Fake GPU").measured == model.measured


def test_fp8_is_no_candidate_before_sm89(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    plan = qfuse.route(prepared_model(), 8192, ANALYTIC)
    assert plan.choices["0"] == "int8" and "fp8" not in plan.predictions["0"]


def test_measure_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert CostModel.current().measured == {}
    with pytest.raises(qfuse.QFuseError, match="CUDA"):
        CostModel().measure([(16, 64, 64)])
    with pytest.raises(qfuse.QFuseError, match="CUDA"):
        qfuse.route(prepared_model(d=64), 16, measure=True)


@pytest.mark.gpu
def test_measure_on_the_gpu_fills_and_reuses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QFUSE_CACHE_DIR", str(tmp_path))
    prepared = prepared_model(d=1024)
    plan = qfuse.route(prepared, tokens=2048, measure=True)
    assert all(src == "measured" for p in plan.predictions.values() for _, src in p.values())
    cached = CostModel.current()
    assert len(cached.measured) == 6  # 2 shapes x 3 implementations
    again = qfuse.route(prepared, tokens=2048)
    assert again.predictions == plan.predictions
