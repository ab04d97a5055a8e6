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


# Issue #23, row by row: what a new user met, and what they get now ----------------------------


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_row5_a_batch_1_example_says_the_batch_is_pinned():
    with pytest.warns(UserWarning, match="batch of 'input' has size 1.*batch of 2 or more"):
        prepared = qfuse.prepare(_mlp(), qfuse.QConfig.int8_static(), (torch.randn(1, 8),))
    prepared(torch.randn(1, 8))
    with pytest.raises(qfuse.ShapeError):
        qfuse.convert(prepared)(torch.randn(4, 8))


def test_row6_selections_that_match_nothing_are_errors():
    model, x, cfg = _mlp(), torch.randn(4, 8), qfuse.QConfig.int8_static()
    with pytest.raises(qfuse.UnsupportedError, match=r"GPTQ\(layers=...\) glob 'nothing\*'"):
        qfuse.prepare(model, cfg, (x,), gptq=qfuse.GPTQ(layers=("nothing*",)))
    with pytest.raises(qfuse.UnsupportedError, match="SmoothQuant: no layer is eligible.*layers="):
        qfuse.prepare(model, cfg, (x,), smoothquant=qfuse.SmoothQuant())  # Linear after ReLU
    with pytest.raises(qfuse.UnsupportedError, match=r"SmoothQuant\(layers=...\) glob 'x'"):
        qfuse.prepare(model, cfg, (x,), smoothquant=qfuse.SmoothQuant(layers=("x",)))
    with pytest.raises(qfuse.UnsupportedError, match="symmetric='no': pass True or False"):
        qfuse.QConfig(symmetric="no")
    with pytest.raises(qfuse.UnsupportedError, match="observer=3"):
        qfuse.QConfig(observer=3)


def test_row6_prepare_on_a_prepared_or_converted_model_says_so():
    model, x, cfg = _mlp(), torch.randn(4, 8), qfuse.QConfig.int8_static()
    prepared = qfuse.prepare(model, cfg, (x,))
    prepared(x)
    with pytest.raises(qfuse.ModeError, match="already prepared.*qfuse.convert"):
        qfuse.prepare(prepared, cfg, (x,))
    for output in ("graph", "model"):
        with pytest.raises(qfuse.ModeError, match="already converted.*float model"):
            qfuse.prepare(qfuse.convert(prepared, output=output), cfg, (x,))


def test_row6_prepare_keeps_the_users_train_mode():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    model[2].eval()  # mixed modes come back as they were
    qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 8),))
    assert model.training and model[0].training and not model[2].training


def test_row7_an_int64_example_names_the_input_and_the_fix():
    with pytest.raises(qfuse.UnsupportedError, match="'input' is torch.int64.*x.float()"):
        qfuse.prepare(_mlp(), qfuse.QConfig.int8_static(), (torch.randint(0, 5, (4, 8)),))


def test_row8_save_creates_the_folder_and_refuses_a_folder(tmp_path):
    model, x = _mlp(), torch.randn(4, 8)
    _, qmodel = _converted(model, x)
    path = tmp_path / "new" / "deeper" / "model.safetensors"
    qfuse.save(qmodel, path)
    assert torch.equal(qfuse.load(path, model, (x,))(x), qmodel(x))
    qfuse.export_program(qmodel, (x,), tmp_path / "other" / "model.pt2")
    assert (tmp_path / "other" / "model.pt2").is_file()
    with pytest.raises(qfuse.QFuseError, match="is a folder; pass the path of a file"):
        qfuse.save(qmodel, tmp_path)
    assert not [p for p in (tmp_path / "new" / "deeper").iterdir() if p.name.startswith(".")]


def test_row9_a_wrong_example_shape_names_the_cause_quietly(capfd):
    with pytest.raises(qfuse.ShapeError, match=r"Sequential itself fails on the example inputs "
                       r"\(RuntimeError: mat1 and mat2 shapes.*got \(\(2, 9\),\)"):
        qfuse.prepare(_mlp(), qfuse.QConfig.int8_static(), (torch.randn(2, 9),))
    assert "Traceback" not in capfd.readouterr().err  # torch's fake-tensor log stays quiet


def test_row9_bad_example_tensors():
    cfg = qfuse.QConfig.int8_static()
    with pytest.raises(qfuse.ShapeError, match="empty batch; pass at least one sample"):
        qfuse.prepare(_mlp(), cfg, (torch.randn(0, 8),))
    with pytest.raises(qfuse.ShapeError, match="holds no data.*real example tensors"):
        qfuse.prepare(_mlp(), cfg, (torch.randn(2, 8, device="meta"),))


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.lstm = nn.Conv1d(4, 8, 3, padding=1), nn.LSTM(8, 8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):  # x: [B, 4, T]
        h, _ = self.lstm(self.conv(x).permute(2, 0, 1))
        return self.fc(h)


def test_row10_summary_lists_the_lstm_and_names_the_conv1d(capfd):
    model, x = WithLSTM().eval(), torch.randn(2, 4, 5)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    assert "were assigned during export" not in capfd.readouterr().err
    for qmodel in (prepared, qfuse.convert(prepared)):
        rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
        assert rows["lstm"]["pattern"] == "LSTM" and rows["lstm"]["precision"] == "float"
        assert "recurrent layer" in rows["lstm"]["note"]
        assert rows["conv"]["pattern"] == "Conv1d"


def test_row11_progress_is_quiet_off_a_terminal_and_torch_logs_stay_off(capfd):
    model, x = _mlp(), torch.randn(4, 8)
    prepared, _ = _converted(model, x)
    report = qfuse.sensitivity(prepared, data=[x], quiet=False)  # stderr is not a terminal here
    qfuse.auto_fallback(prepared, lambda m: -float((m(x) - model(x)).abs().max()), 1.0,
                        data=[x], report=report)
    err = capfd.readouterr().err
    assert "specialized" not in err and "%|" not in err  # no bar, no export log lines
    with pytest.raises(qfuse.QFuseError, match=r"layers \['nope'\] are not quantizable"):
        qfuse.sensitivity(prepared, data=[x], layers=["nope"])


def test_row12_13_python_m_qfuse_without_torchao(capsys, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    from qfuse.cli import main

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("torchao") for d in project["dependencies"])
    assert any(d.startswith("torchao") for d in project["optional-dependencies"]["bench"])
    # One fresh interpreter: ``python -m qfuse --version`` runs qfuse/__main__.py, which (with
    # everything the CLI imports) must not import torchao.
    code = ("import runpy, sys\nsys.argv = ['qfuse', '--version']\ntry:\n"
            "    runpy.run_module('qfuse', run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('torchao' in sys.modules, e.code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         check=True)
    assert out.stdout.split() == ["qfuse", qfuse.__version__, "False", "0"]
    monkeypatch.setenv("COLUMNS", "60")
    for args in (["--help"], ["sweep", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(args)
        text = capsys.readouterr().out
        assert info.value.code == 0 and "``" not in text and "usage: qfuse" in text
    assert "int8_dynamic," in text and "fp8_dynamic," in text  # wrapped between words only
    assert "Exit status: 0 when every config ran, 1 when any config failed" in " ".join(
        text.split())


def test_row14_cuda_on_a_cpu_machine_and_failed_rows_exit_nonzero(tmp_path, capsys, monkeypatch):
    from qfuse.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sweep", "--recipe", "mlp", "--reduced", "--device", "cuda", "--quiet",
                 "--out", str(tmp_path / "x")]) == 2
    assert "CUDA is not available on this machine" in capsys.readouterr().err
    recipe = tmp_path / "broken.py"
    recipe.write_text(
        "import torch\nfrom qfuse.tools import SweepSpec\n"
        "def sweep_spec(reduced=False):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()\n"
        "    def evaluate(m):\n        raise RuntimeError('broken metric')\n"
        "    return SweepSpec('broken', model, [torch.randn(2, 4)], evaluate, torch.randn(2, 4))\n"
    )
    rc = main(["sweep", "--recipe", str(recipe), "--configs", "fp32,int8_static", "--quiet",
               "--device", "cpu", "--repeats", "1", "--out", str(tmp_path / "broken")])
    assert rc == 1 and "2 of 2 configs failed" in capsys.readouterr().err


def test_row15_dynamic_configs_quantize_conv2d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3),
                          nn.Flatten(), nn.Linear(16, 3)).eval()
    x = torch.randn(4, 1, 4, 4)
    for cfg in (qfuse.QConfig.int8_dynamic(), qfuse.QConfig.fp8_dynamic()):
        prepared = qfuse.prepare(model, cfg, (x,))
        prepared(x)
        qmodel = qfuse.convert(prepared)
        rows = qfuse.summary(qmodel).rows
        assert [r["precision"] != "float" for r in rows] == [True] * 3
        assert "per tensor (dynamic)" in rows[0]["input"]
        with torch.no_grad():
            err = (qmodel(x) - model(x)).norm() / model(x).norm()
        assert err < 0.1
