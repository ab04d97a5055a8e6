"""A static model with per-token layers (``prepare(layer_configs={"*.down_proj":
QConfig.int8_dynamic()})``): those layers quantize their input per token at run time, their
producers hand them float instead of int8, and every other layer keeps its static scale. A real
Llama needs it where one range per tensor cannot serve: SmolLM2's ``down_proj`` inputs carry
attention-sink tokens up to 2000 times the 99.9th percentile (``recipes/ptq_llm.py``)."""

from __future__ import annotations

import pytest
import torch

import qfuse
from qfuse.analysis.summary import summary
from qfuse.nn import QLinear
from tests.models import tiny_llama

pytest.importorskip("transformers")

DYNAMIC = {"*.down_proj": qfuse.QConfig.int8_dynamic()}


def _ids(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (batch, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(layers=2)
    with torch.no_grad():  # a sink-like token: one position's down_proj input 100x the rest
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[5, 40]] *= 30.0
    return model


def _converted(model, layer_configs, output, **kw):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (),
                             example_kwargs={"input_ids": _ids(0)}, layer_configs=layer_configs,
                             **kw)
    with torch.no_grad():
        for seed in (1, 2):
            prepared(input_ids=_ids(seed, batch=4))
    return qfuse.convert(prepared, output=output)


@pytest.mark.parametrize("output", ["model", "graph"])
def test_down_proj_per_token_in_a_static_model(llama, output):
    qmodel = _converted(llama, DYNAMIC, output)
    rows = {r["name"]: r for r in summary(qmodel).rows}
    downs = [r for name, r in rows.items() if name.endswith("down_proj") or name.endswith(".down")]
    others = [r for name, r in rows.items() if r not in downs]
    assert len(downs) == 2 and others
    mods = {n: m for n, m in qmodel.named_modules() if isinstance(m, QLinear)}
    down_mods = [m for n, m in mods.items() if n.endswith("down_proj") or n.endswith(".down")]
    assert len(down_mods) == 2 and all(m.dynamic and m.x_scale is None for m in down_mods)
    assert all(not m._input_quantized for m in down_mods)  # float from gate/up, not int8
    static = [m for n, m in mods.items() if m not in down_mods]
    assert static and all(not m.dynamic for m in static)
    with torch.no_grad():
        out = qmodel(input_ids=_ids(9))
    out = out.logits if hasattr(out, "logits") else out[0]
    assert torch.isfinite(out).all()


def test_per_token_down_proj_is_closer_to_float_than_static(llama):
    """What the option is for: the outlier tokens no longer set one range for every token."""
    ids = _ids(9)
    with torch.no_grad():
        ref = llama(input_ids=ids).logits
        errs = {}
        for name, lc in (("static", None), ("per-token down", DYNAMIC)):
            out = _converted(llama, lc, "model")(input_ids=ids).logits
            errs[name] = (out - ref).norm() / ref.norm()
    assert errs["per-token down"] < errs["static"]


def test_smoothquant_folds_into_up_rows_for_a_per_token_down_proj(llama):
    """A per-token layer has no static scale to carry factors in its prologue (build refuses
    that, naming the layer): down_proj's factors go into up_proj's rows, which stay static."""
    qmodel = _converted(llama, DYNAMIC, "model",
                        smoothquant=qfuse.SmoothQuant(0.8, layers=("*",)))
    rows = {r["name"]: r for r in summary(qmodel).rows}
    assert rows["model.layers.0.mlp.down"]["input"] == "float → int8 per token (dynamic)"
    assert rows["model.layers.0.mlp.gate_up"]["input"] == "float → int8 in prologue"
    with torch.no_grad():
        assert torch.isfinite(qmodel(input_ids=_ids(9)).logits).all()


def test_quantized_outputs_calibration_refuses_mixed_schemes(llama):
    from qfuse.errors import UnsupportedError

    prepared = qfuse.prepare(llama, qfuse.QConfig.int8_static(), (),
                             example_kwargs={"input_ids": _ids(0)}, layer_configs=DYNAMIC)
    from qfuse.calibrate.quantized import quantized_twin

    with pytest.raises(UnsupportedError, match="layer_configs"):
        quantized_twin(prepared, None)


@pytest.mark.gpu
def test_mixed_schemes_run_the_triton_kernels_on_cuda(llama):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the device machine")
    import copy

    model = copy.deepcopy(llama).to("cuda", torch.bfloat16)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (),
                             example_kwargs={"input_ids": _ids(0).cuda()}, layer_configs=DYNAMIC,
                             smoothquant=qfuse.SmoothQuant(0.8, layers=("*",)))
    with torch.no_grad():
        for seed in (1, 2):
            prepared(input_ids=_ids(seed, batch=4).cuda())
    qmodel = qfuse.convert(prepared, output="model")
    ids = _ids(9).cuda()
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        out = qmodel(input_ids=ids).logits.float()
    assert (out - ref).norm() / ref.norm() < 0.1
    rows = {r["name"]: r for r in summary(qmodel).rows}
    assert rows["model.layers.0.mlp.down"]["input"] == "float → int8 per token (dynamic)"


def _calibrated(model, **kw):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (),
                             example_kwargs={"input_ids": _ids(0)}, **kw)
    with torch.no_grad():
        for seed in (1, 2):
            prepared(input_ids=_ids(seed, batch=4))
    return prepared


def test_convert_per_token_equals_the_layer_config(llama):
    """``convert(per_token=...)`` on a static prepared model: the same layers and outputs as
    preparing with a dynamic layer config, and the prepared model keeps its own state."""
    downs = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    plain = _calibrated(llama)
    by_convert = qfuse.convert(plain, output="model", per_token=downs)
    by_prepare = qfuse.convert(_calibrated(llama, layer_configs=DYNAMIC), output="model")
    ids = _ids(9)
    with torch.no_grad():
        assert torch.equal(by_convert(input_ids=ids).logits, by_prepare(input_ids=ids).logits)
    again = qfuse.convert(plain, output="model")  # per_token did not stick to the prepared one
    assert not any(m.dynamic for m in again.modules() if isinstance(m, QLinear))


def test_per_token_refuses_unknown_layers_and_dynamic_configs(llama):
    with pytest.raises(qfuse.QFuseError, match="not fusible chains"):
        qfuse.convert(_calibrated(llama), per_token=["model.layers.0.mlp.dwn_proj"])
    dyn = qfuse.prepare(llama, qfuse.QConfig.int8_dynamic(), (),
                        example_kwargs={"input_ids": _ids(0)})
    with pytest.raises(qfuse.UnsupportedError, match="already dynamic"):
        qfuse.convert(dyn, per_token=["model.layers.0.mlp.down_proj"])
    with pytest.raises(qfuse.QFuseError, match="already dynamic"):
        qfuse.auto_fallback(dyn, lambda m: 0.0, max_layers=1, fallback="per-token", quiet=True)


def test_auto_fallback_moves_layers_to_per_token(llama):
    prepared = _calibrated(llama)
    ids = _ids(9)
    with torch.no_grad():
        ref = llama(input_ids=ids).logits

    def score(m):  # higher is better
        with torch.no_grad():
            out = m(input_ids=ids)
        out = out.logits if hasattr(out, "logits") else out[0]
        return -float((out - ref).norm() / ref.norm())

    qmodel, fb = qfuse.auto_fallback(prepared, score, max_layers=2, fallback="per-token",
                                     data=[{"input_ids": ids}], quiet=True)
    assert fb.fallback == "per-token" and fb.moved == 2 and len(fb.fallback_layers) == 2
    rows = {r["name"]: r for r in summary(qmodel).rows}
    for name in fb.fallback_layers:
        assert rows[name]["input"] == "float → int8 per token (dynamic)", (name, rows[name])
    assert sum(r["input"] == "float → int8 per token (dynamic)" for r in rows.values()) == 2


def test_mixed_schemes_save_and_load(llama, tmp_path):
    """A saved static model with per-token down_proj loads with the same schemes and outputs."""
    import copy

    graph = qfuse.convert(_calibrated(llama, layer_configs=DYNAMIC))
    path = tmp_path / "mixed.safetensors"
    qfuse.save(graph, path)
    loaded = qfuse.load(path, copy.deepcopy(llama), (), {"input_ids": _ids(0)})
    ids = _ids(9)
    with torch.no_grad():
        a, b = graph(input_ids=ids), loaded(input_ids=ids)
    a = a.logits if hasattr(a, "logits") else a[0]
    b = b.logits if hasattr(b, "logits") else b[0]
    assert torch.equal(a, b)
    inputs = {r["name"]: r["input"] for r in summary(loaded).rows}
    assert inputs["model.layers.0.mlp.down_proj"] == "float → int8 per token (dynamic)"
    assert inputs["model.layers.0.mlp.gate_proj_up_proj"] != "float → int8 per token (dynamic)"
