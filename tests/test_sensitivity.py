import math

import pytest
import torch
from torch import nn

import qfuse
from qfuse.analysis.sensitivity import output_sqnr_db
from tests.optional import needs


def planted_model(layers: int = 4, outliers=(4,)) -> nn.Sequential:
    """``layers`` Linear layers (names 0, 2, 4, ...); each layer in ``outliers`` reads one
    channel of magnitude ~500 that its weight ignores, so a per-tensor int8 input scale wipes out
    all its other inputs."""
    torch.manual_seed(0)
    widths = [16, *[32] * (layers - 1), 8]
    parts = []
    for n_in, n_out in zip(widths, widths[1:], strict=False):
        parts += [nn.Linear(n_in, n_out), nn.ReLU()]
    model = nn.Sequential(*parts[:-1]).eval()
    with torch.no_grad():
        for i in outliers:
            model[i - 2].bias[5] = 500.0
            model[i].weight[:, 5] = 0.0
    return model


def calibrated(model, x):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    with torch.no_grad():
        prepared(x)
    return prepared


def test_sensitivity_ranks_the_planted_layer_first(tmp_path):
    x = torch.randn(64, 16)
    prepared = calibrated(planted_model(), x)
    report = qfuse.sensitivity(prepared, data=[x])
    ranked = report.ranked()
    assert ranked[0].name == "4"
    assert ranked[0].sqnr_db < 15 < min(r.sqnr_db for r in ranked[1:])
    assert "layer" in str(report).splitlines()[0]
    # measuring must not have recalibrated the observers
    assert all(int(m.num_batches) == 1 for m in prepared.modules() if hasattr(m, "num_batches"))
    needs("matplotlib", "recipes")
    png = report.plot(str(tmp_path / "sens.png"))
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_auto_fallback_keeps_exactly_the_planted_layer():
    model = planted_model()
    x = torch.randn(64, 16)
    prepared = calibrated(model, x)
    with torch.no_grad():
        ref = model(x)

    def eval_fn(m):  # output SQNR in dB: higher is better, float scores +inf -> cap it
        with torch.no_grad():
            return min(output_sqnr_db([ref], [m(x)]), 100.0)

    qmodel, result = qfuse.auto_fallback(prepared, eval_fn, max_drop=100.0 - 30.0)
    assert list(result.kept_float) == ["4"]
    assert result.metric >= 30.0
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["4"]["precision"] == "float" and "auto_fallback" in rows["4"]["note"]
    assert all(rows[n]["precision"] == "int8" for n in ("0", "2", "6"))
    # deterministic
    _, again = qfuse.auto_fallback(prepared, eval_fn, max_drop=70.0, report=result.report)
    assert again.kept_float == result.kept_float


def test_auto_fallback_keeps_nothing_when_budget_allows():
    x = torch.randn(32, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    prepared = calibrated(model, x)
    _, result = qfuse.auto_fallback(prepared, lambda m: 1.0, max_drop=0.0)
    assert result.kept_float == {}


def test_sensitivity_needs_something_to_measure():
    prepared = calibrated(planted_model(), torch.randn(4, 16))
    with pytest.raises(qfuse.QFuseError, match="data"):
        qfuse.sensitivity(prepared)
    assert math.isinf(output_sqnr_db([torch.ones(3)], [torch.ones(3)]))


def test_auto_fallback_to_fp8_moves_the_planted_layer_and_keeps_it_fused():
    model = planted_model()
    x = torch.randn(64, 16)
    prepared = calibrated(model, x)
    with torch.no_grad():
        ref = model(x)

    def eval_fn(m):
        with torch.no_grad():
            return min(output_sqnr_db([ref], [m(x)]), 100.0)

    qmodel, result = qfuse.auto_fallback(prepared, eval_fn, max_drop=75.0, fallback="fp8")
    assert list(result.fallback_layers) == ["4"] and result.kept_float == {}
    assert result.metric >= 25.0
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["4"]["precision"] == "fp8_e4m3" and "auto_fallback to fp8" in rows["4"]["note"]
    assert all(rows[n]["precision"] == "int8" for n in ("0", "2", "6"))


def test_auto_fallback_rejects_unknown_mode():
    prepared = calibrated(planted_model(), torch.randn(8, 16))
    with pytest.raises(qfuse.QFuseError, match="fallback"):
        qfuse.auto_fallback(prepared, lambda m: 1.0, 0.0, fallback="int4")


def test_evaluation_count_excludes_a_reused_report():
    x = torch.randn(16, 16)
    prepared = calibrated(planted_model(), x)
    _, first = qfuse.auto_fallback(prepared, lambda m: 1.0, max_drop=0.0, data=[x])
    _, again = qfuse.auto_fallback(prepared, lambda m: 1.0, max_drop=0.0, report=first.report)
    assert first.evaluations - again.evaluations == len(first.report.rows)


def test_sensitivity_of_a_float_model_prepares_and_calibrates_it():
    x = torch.randn(64, 16)
    model = planted_model()
    report = qfuse.sensitivity(model, qfuse.QConfig.int8_static(), data=[x[:32], x[32:]])
    assert report.ranked()[0].name == "4"
    with pytest.raises(qfuse.QFuseError, match="config=qfuse.QConfig"):
        qfuse.sensitivity(model, data=[x])
    with pytest.raises(qfuse.QFuseError, match="needs data"):
        qfuse.sensitivity(model, qfuse.QConfig.int8_static(), eval_fn=lambda m: 1.0)
    converted = qfuse.convert(calibrated(model, x))
    with pytest.raises(qfuse.QFuseError, match="not a converted one"):
        qfuse.sensitivity(converted, data=[x])


def test_local_sensitivity_ranks_like_the_full_one_without_converting(monkeypatch):
    """method="local" (each layer's own output, fake-quantized in place) puts the planted layer
    first, as the full method (a convert per layer) does, and never converts or recalibrates."""
    x = torch.randn(64, 16)
    prepared = calibrated(planted_model(), x)
    full = qfuse.sensitivity(prepared, data=[x], quiet=True)
    import qfuse.analysis.sensitivity as sens

    def no_convert(*args, **kwargs):
        raise AssertionError("the local method converted the model")

    monkeypatch.setattr(sens, "convert", no_convert)
    local = qfuse.sensitivity(prepared, data=[x], quiet=True, method="local")
    assert local.ranked()[0].name == full.ranked()[0].name == "4"
    ranked = local.ranked()
    assert ranked[0].sqnr_db < 15 < min(r.sqnr_db for r in ranked[1:])
    assert all(r.metric is None and r.drop is None for r in local.rows)
    assert all(int(m.num_batches) == 1 for m in prepared.modules() if hasattr(m, "num_batches"))
    with pytest.raises(qfuse.QFuseError, match="local"):
        qfuse.sensitivity(prepared, data=[x], eval_fn=lambda m: 1.0, method="local")
    with pytest.raises(qfuse.QFuseError, match="method"):
        qfuse.sensitivity(prepared, data=[x], method="fast")


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (qfuse.QConfig.int8_static(), {}),
        (qfuse.QConfig.int8_static(), {"smoothquant": qfuse.SmoothQuant(0.8, layers=("*",)),
                                       "gptq": qfuse.GPTQ()}),
        (qfuse.QConfig.int8_dynamic(), {"gptq": qfuse.GPTQ()}),
        (qfuse.QConfig.fp8_dynamic(), {}),
    ],
)
def test_local_sqnr_of_the_last_layer_is_the_full_one(config, kwargs):
    """The last layer's output is the model's: quantized alone, both methods measure the same
    thing, so the local fake-quant (SmoothQuant factors, GPTQ weights, static or per-token input
    scales) must give the converted model's SQNR."""
    x = torch.randn(64, 16)
    prepared = qfuse.prepare(planted_model(), config, (x,), **kwargs)
    with torch.no_grad():
        prepared(x)
    full = {r.name: r.sqnr_db for r in qfuse.sensitivity(prepared, data=[x], quiet=True).rows}
    local = {r.name: r.sqnr_db for r in
             qfuse.sensitivity(prepared, data=[x], quiet=True, method="local").rows}
    assert local["6"] == pytest.approx(full["6"], abs=0.05)


def test_local_sensitivity_undoes_a_factor_folded_into_the_producer():
    """SmoothQuant folds ``x / s`` into the producer Linear's rows; that layer's own output is
    then ``y / s``, and the local method compares it to float's ``y`` after multiplying back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).eval()
    x = torch.randn(64, 16)

    def local(**kwargs):
        prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), **kwargs)
        with torch.no_grad():
            prepared(x)
        return {r.name: r.sqnr_db for r in
                qfuse.sensitivity(prepared, data=[x], quiet=True, method="local").rows}

    plain, smoothed = local(), local(smoothquant=qfuse.SmoothQuant(0.5))
    # per-channel weight scales follow the rows: the producer's error is unchanged
    assert smoothed["0"] == pytest.approx(plain["0"], abs=0.1)
