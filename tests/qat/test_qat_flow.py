"""prepare_qat -> train -> convert: the fake-quant model predicts the converted one; scales,
freezing, Conv+BN, PTQ carry-over and errors."""

import copy
import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.fusion.bn_fold import fold_conv_bn
from qfuse.nn import QConv2d, QLinear
from qfuse.primitives import quantize_weight
from tests.models import ConvNet, LNBlock, MLPBlock, randomize_batchnorm

# The converted layer's integer GEMM and the fake-quant model's float GEMM on the same grid values
# differ only by float32 rounding of the accumulation and the epilogue: measured <= 1.3e-7 of the
# output's magnitude; REL_TOL = 1e-5 leaves room for other BLAS orders and still catches any
# one-step difference in a code (a step is ~1/128 of the range). Where a layer hands int8 to the
# next, that float rounding can flip a requantized code that sits on a rounding tie by one step
# (measured: 1 code in 4096 after training, which moved the 64 outputs of its row: 1.5%). So
# chained models must agree to REL_TOL in the median (a systematic difference moves it), on most
# outputs (FLIP_SHARE) and within FLIP_TOL everywhere.
REL_TOL = 1e-5
FLIP_SHARE, FLIP_TOL = 0.25, 0.05

STATIC = {
    "int8": qfuse.QConfig.int8_static(),
    "int8_asym": qfuse.QConfig.int8_static_asymmetric(),
    "fp8": qfuse.QConfig.fp8_static(),
}
DYNAMIC = {"int8_dyn": qfuse.QConfig.int8_dynamic(), "fp8_dyn": qfuse.QConfig.fp8_dynamic()}


def make(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPBlock().train(), torch.randn(16, 32)
    return randomize_batchnorm(ConvNet()).train(), torch.randn(8, 1, 8, 8)


def train(qat, x, steps=4, lr=1e-3):
    opt = torch.optim.SGD(qat.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    qat.train()
    for _ in range(steps):
        loss = qat(torch.randn(x.shape, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return qat.eval()


def assert_agrees(qat, qmodel, x, chained=True):
    with torch.no_grad():
        fq, out = qat(x), qmodel(x)
    scale = fq.abs().max().item()
    if not chained:
        torch.testing.assert_close(out, fq, rtol=0, atol=REL_TOL * scale)
        return
    diff = (out - fq).abs()
    assert diff.median() <= REL_TOL * scale
    assert (diff > REL_TOL * scale).float().mean() <= FLIP_SHARE
    assert diff.max() <= FLIP_TOL * scale


# Conv2d is static only, and learnable scales need a static scale (see the error tests).
CASES = [
    (kind, name, learnable)
    for kind in ("mlp", "conv")
    for name in (*STATIC, *DYNAMIC)
    for learnable in (False, True)
    if not (name in DYNAMIC and (kind == "conv" or learnable))
]


@pytest.mark.parametrize(("kind", "name", "learnable"), CASES)
def test_fake_quant_predicts_converted_model(kind, name, learnable):
    config = {**STATIC, **DYNAMIC}[name]
    model, x = make(kind)
    qat = qfuse.prepare_qat(
        model, config, (x,), qat=qfuse.QATConfig(learnable_scales=learnable, bn_freeze_step=2)
    )
    qmodel = qfuse.convert(train(qat, x))
    assert_agrees(qat, qmodel, x)
    # the same fused modules and patterns as PTQ of the float model
    prepared = qfuse.prepare(copy.deepcopy(model).eval(), config, (x,))
    with torch.no_grad():
        prepared(x)
    ptq = qfuse.convert(prepared)
    rows = lambda m: [
        (r["name"], r["pattern"], r["input"], r["output"]) for r in qfuse.summary(m).rows
    ]  # noqa: E731
    assert rows(qmodel) == rows(ptq)
    assert [type(m) for m in qmodel.modules() if isinstance(m, (QLinear, QConv2d))] == [
        type(m) for m in ptq.modules() if isinstance(m, (QLinear, QConv2d))
    ]


def test_training_changes_the_model_not_the_float_teacher():
    model, x = make("mlp")
    before = copy.deepcopy(model.state_dict())
    qat = train(qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,)), x, lr=0.1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(qat.get_parameter("up.weight"), before["up.weight"])


def test_observer_scales_freeze_after_the_configured_step():
    model, x = make("mlp")
    qat = qfuse.prepare_qat(
        model, qfuse.QConfig.int8_static(), (x,), qat=qfuse.QATConfig(observer_freeze_step=2)
    )
    fq = qat.get_submodule("qfuse_qat_act_x")
    scales = []
    for scale_up in (1.0, 2.0, 4.0, 8.0):
        qat(x * scale_up)
        scales.append(float(fq.scale))
    assert scales[1] > scales[0] and scales[2] == scales[3] == scales[1]
    qat.eval()(x * 100)  # eval mode never observes
    assert float(fq.scale) == scales[1]


def test_learnable_scales_are_parameters_trained_by_the_optimizer():
    model, x = make("mlp")
    qat = qfuse.prepare_qat(
        model, qfuse.QConfig.int8_static(), (x,), qat=qfuse.QATConfig(learnable_scales=True)
    )
    names = [n for n, _ in qat.named_parameters() if n.endswith(".scale")]
    assert "qfuse_qat_act_x.scale" in names and "qfuse_qat_weight_up.scale" in names
    fq = qat.get_submodule("qfuse_qat_act_x")
    qat(x)  # the observer starts the scale from the first batch ...
    start = float(fq.scale.detach())
    assert start == pytest.approx(float(x.abs().max()) / 127.5)
    qat(x * 10)  # ... and never moves it again: only gradients do
    assert float(fq.scale.detach()) == start
    train(qat, x, steps=2, lr=0.1)
    assert float(fq.scale.detach()) != start
    assert fq.observer.num_batches.item() == 1


def test_conv_bn_keeps_batch_statistics_until_frozen_then_folds_exactly():
    model, x = make("conv")
    qat = qfuse.prepare_qat(
        model, qfuse.QConfig.int8_static(), (x,), qat=qfuse.QATConfig(bn_freeze_step=2)
    )
    mean = qat.get_buffer("bn1.running_mean")
    history = []
    for _ in range(4):
        qat(torch.randn_like(x) + 1.0)
        history.append(mean.clone())
    assert not torch.equal(history[0], history[1])  # steps 1, 2 update BN statistics
    assert torch.equal(history[1], history[2]) and torch.equal(history[2], history[3])
    assert not any(isinstance(m, nn.BatchNorm2d) for m in qat.modules())
    qmodel = qfuse.convert(qat.eval())
    w, _ = fold_conv_bn(
        *(qat.get_parameter(n) for n in ("conv1.weight",)),
        None,
        qat.get_parameter("bn1.weight"),
        qat.get_parameter("bn1.bias"),
        qat.get_buffer("bn1.running_mean"),
        qat.get_buffer("bn1.running_var"),
        1e-5,
    )
    q, scale = quantize_weight(w.detach(), per_channel=True)
    assert torch.equal(qmodel.get_submodule("conv1").weight, q)
    assert torch.equal(qmodel.get_submodule("conv1").weight_scale, scale)
    assert_agrees(qat, qmodel, x)


@pytest.mark.parametrize("name", [*STATIC, *DYNAMIC])
def test_single_layer_agrees_to_float_rounding(name):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(83, 129), nn.GELU()).train(), torch.randn(7, 83)
    qat = train(qfuse.prepare_qat(model, {**STATIC, **DYNAMIC}[name], (x,)), x)
    assert_agrees(qat, qfuse.convert(qat), x, chained=False)


def test_dropout_follows_train_and_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)).train()
    x = torch.randn(32, 16)
    qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,))
    assert not torch.equal(qat(x), qat(x))  # train mode drops
    qat.eval()
    assert torch.equal(qat(x), qat(x))
    assert_agrees(qat, qfuse.convert(qat), x)


def smoothed_ptq_and_qat():
    """An LNBlock calibrated with SmoothQuant(0.5), and QAT started from it: (x, prepared, qat)."""
    torch.manual_seed(0)
    model, x = LNBlock().eval(), torch.randn(64, 64)
    config = qfuse.QConfig.int8_static_asymmetric()
    prepared = qfuse.prepare(model, config, (x,), smoothquant=qfuse.SmoothQuant(0.5))
    with torch.no_grad():
        prepared(x)
    qat = qfuse.prepare_qat(model.train(), config, (x,), from_prepared=prepared).eval()
    return x, prepared, qat


def test_starting_from_ptq_keeps_its_scales_and_smoothquant_factors():
    x, prepared, qat = smoothed_ptq_and_qat()
    ptq = qfuse.convert(prepared)
    from_qat = qfuse.convert(qat)
    for name in ("fc", "fc2"):
        a, b = ptq.get_submodule(name), from_qat.get_submodule(name)
        for buf in ("weight", "weight_scale", "x_scale", "x_inv_scale", "x_zero_point"):
            va, vb = getattr(a, buf), getattr(b, buf)
            assert (va is None and vb is None) or torch.equal(va, vb), (name, buf)
    notes = {r["name"]: r["note"] for r in qfuse.summary(from_qat).rows}
    assert notes["fc"] == "QAT; SmoothQuant from PTQ (prologue)"
    with torch.no_grad():
        torch.testing.assert_close(from_qat(x), ptq(x), rtol=0, atol=1e-5)
    assert_agrees(qat, from_qat, x)
    train(qat, x, steps=2)  # and it trains on from there
    assert_agrees(qat, qfuse.convert(qat), x)


@pytest.mark.parametrize("output", ["graph", "model"])
def test_a_smoothed_layer_kept_float_gets_its_float_weight_back(output):
    """QAT trains ``W * s`` for a layer with SmoothQuant's prologue; kept float, nothing divides
    its input by ``s``, so the weight must be ``W`` again (it was off by the factors)."""
    x, prepared, qat = smoothed_ptq_and_qat()
    ptq = qfuse.convert(prepared, keep_float={"fc": "test"}, output=output)
    from_qat = qfuse.convert(qat, keep_float={"fc": "test"}, output=output)
    with torch.no_grad():
        torch.testing.assert_close(from_qat(x), ptq(x), rtol=0, atol=1e-5)


def test_converted_qat_model_saves_and_loads(tmp_path):
    model, x = make("conv")
    qat = train(qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,)), x)
    qmodel = qfuse.convert(qat)
    path = os.path.join(tmp_path, "qat.safetensors")
    qfuse.save(qmodel, path)
    loaded = qfuse.load(path, ConvNet(), (x,))
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    assert str(qfuse.summary(loaded)) == str(qfuse.summary(qmodel))


def test_prepare_qat_refuses_an_eval_mode_model():
    with pytest.raises(qfuse.ModeError, match="model.train\\(\\)"):
        qfuse.prepare_qat(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))


def test_convert_refuses_a_qat_model_in_train_mode():
    model, x = make("mlp")
    qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,))
    qat(x)
    with pytest.raises(qfuse.ModeError, match="eval\\(\\)"):
        qfuse.convert(qat)


def test_learnable_scales_need_an_observer_that_can_start_them():
    model, x = make("mlp")
    with pytest.raises(qfuse.UnsupportedError, match="PerToken"):
        qfuse.prepare_qat(
            model,
            qfuse.QConfig.int8_dynamic(),
            (x,),
            qat=qfuse.QATConfig(learnable_scales=True),
        )


def test_evaluating_before_any_training_step_names_the_layer():
    model, x = make("mlp")
    qat = qfuse.prepare_qat(model, qfuse.QConfig.int8_static(), (x,)).eval()
    with pytest.raises(qfuse.CalibrationError, match="up \\(input\\)"):
        qat(x)


def test_bad_freeze_step_is_refused():
    with pytest.raises(qfuse.UnsupportedError, match="bn_freeze_step"):
        qfuse.QATConfig(bn_freeze_step=-1)
