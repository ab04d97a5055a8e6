"""Bad input as users make it: each gets a typed error naming the problem and the fix."""

import pytest
import torch
from torch import nn

import qfuse
from tests.models import MLPBlock


def _converted(model, x):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    return prepared, qfuse.convert(prepared)


def test_wrong_feature_size_names_input_shape_and_served_shapes():
    prepared, qmodel = _converted(MLPBlock(16, 32).eval(), torch.randn(2, 5, 16))
    for model in (prepared, qmodel):
        with pytest.raises(qfuse.ShapeError) as info:
            model(torch.randn(2, 5, 17))
        msg = str(info.value)
        assert "'x'" in msg and "(2, 5, 17)" in msg and "dimension 2 is 17" in msg
        assert "x (*, *, 16)" in msg


def test_wrong_feature_size_in_the_swapped_model_is_a_shape_error():
    prepared, _ = _converted(MLPBlock(16, 32).eval(), torch.randn(2, 5, 16))
    swapped = qfuse.convert(prepared, output="model")  # the user's class: no captured guards
    with pytest.raises(qfuse.ShapeError, match="17 features .* built for 16"):
        swapped(torch.randn(2, 5, 17))


def test_batch_and_sequence_are_dynamic_by_default():
    model = MLPBlock(16, 32).eval()
    _, qmodel = _converted(model, torch.randn(2, 5, 16))
    for shape in [(1, 1, 16), (7, 3, 16), (3, 50, 16)]:
        x = torch.randn(shape)
        assert qmodel(x).shape == shape
        assert ((qmodel(x) - model(x)).norm() / model(x).norm()) < 0.05


def test_wrong_rank_is_a_shape_error():
    _, qmodel = _converted(MLPBlock(16, 32).eval(), torch.randn(2, 5, 16))
    with pytest.raises(qfuse.ShapeError, match="has 2 dimensions"):
        qmodel(torch.randn(5, 16))


def test_layer_config_glob_typo_lists_closest_names():
    model, x = MLPBlock(16, 32).eval(), torch.randn(2, 16)
    cfg = qfuse.QConfig.int8_static()
    with pytest.raises(qfuse.UnsupportedError, match=r"'dwn' matches no .*'down'"):
        qfuse.prepare(model, cfg, (x,), layer_configs={"dwn": cfg})
    qfuse.prepare(model, cfg, (x,), layer_configs={"do*": cfg})  # a glob that matches is fine


def test_train_mode_is_refused_with_the_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))
    with pytest.raises(qfuse.UnsupportedError) as info:
        qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 1, 6, 6),))
    msg = str(info.value)
    assert "train mode" in msg and "model.eval()" in msg and "prepare_qat" in msg and "1 (" in msg
    assert model.training  # refused before anything touched the model
    qfuse.prepare(model.eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 1, 6, 6),))


def test_train_mode_without_mode_dependent_layers_is_accepted():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # train mode computes the same
    qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 8),))


def test_nothing_to_quantize_warns_and_summary_says_why():
    model = nn.Sequential(nn.LayerNorm(8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="nothing in Sequential can be quantized"):
        prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    (row,) = qfuse.summary(qfuse.convert(prepared)).rows
    assert row["precision"] == "float" and "no Linear, Conv2d" in row["note"]


class Conv1D(nn.Module):
    """transformers' Conv1D: weight stored [in, out], applied with addmm."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) / 10)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


class Gemms(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Conv1D(16, 24)
        self.mat = nn.Parameter(torch.randn(24, 16) / 24**0.5)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.same = nn.Conv1d(16, 8, 3, padding="same")

    def forward(self, x):  # x: [B, T, 16]
        h = torch.relu(self.proj(x)) @ self.mat
        return self.same(torch.relu(self.conv(h.transpose(1, 2))))


def test_gemms_where_models_put_them():
    torch.manual_seed(0)
    model, x = Gemms().eval(), torch.randn(2, 9, 16)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    graph, swapped = qfuse.convert(prepared), qfuse.convert(prepared, output="model")
    for qmodel, matmul in ((graph, "int8"), (swapped, "float")):
        rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
        assert rows["proj"]["precision"] == "int8"
        conv = rows.get("conv") or rows["conv.conv"]  # QConv1d wraps a height-1 QConv2d
        assert conv["precision"] == "int8"
        # x @ self.mat: fused in the graph; no module to swap in the model (the summary says so)
        assert rows["linear_default_1"]["precision"] == matmul
        assert rows["same"]["precision"] == "float" and "string padding" in rows["same"]["note"]
        ref, out = model(x), qmodel(x)
        assert ((out - ref).norm() / ref.norm()) < 0.05
    assert model.proj.weight.shape == (16, 24)  # the float model keeps its own layout
