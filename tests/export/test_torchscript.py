"""qfuse.export_torchscript: the file runs in a fresh process after ``import qfuse``, bit-exact."""

import os

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import qfuse
import qfuse.export.torchscript as qtorchscript
from tests.export.cases import (
    FreshJob,
    accepted_cases,
    assert_same,
    check_in_fresh_process,
    expected_leaves,
    on_cuda,
)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")


def test_fresh_process_reproduces_outputs_of_every_model_and_config(make_case, tmp_path):
    jobs = []
    for i, case in enumerate(accepted_cases(make_case)):
        path = str(tmp_path / f"{case.name}-{i}.ts")
        qfuse.export_torchscript(case.qmodel, case.args, path)
        # These models compute no shapes in Python, so the trace runs at another batch size too.
        label = f"{case.name} {case.config}"
        jobs.append(FreshJob(label, "torchscript", path, case.runs(), case.expected()))
    check_in_fresh_process(jobs, tmp_path)


@pytest.mark.gpu
def test_cuda_models_run_in_a_fresh_process(make_case, tmp_path):
    jobs = []
    for i, case in enumerate(accepted_cases(make_case)):
        qmodel, runs = on_cuda(case)
        path = str(tmp_path / f"{case.name}-{i}.ts")
        qfuse.export_torchscript(qmodel, runs[0][0], path)
        label = f"{case.name} {case.config} cuda"
        jobs.append(FreshJob(label, "torchscript", path, runs, expected_leaves(qmodel, runs)))
    check_in_fresh_process(jobs, tmp_path)


def test_minilm_file_reproduces_outputs(make_case, tmp_path):
    case = make_case("minilm", qfuse.QConfig.int8_static())
    path = tmp_path / "minilm.ts"
    qfuse.export_torchscript(case.qmodel, (), path, example_kwargs=case.kwargs)
    with torch.no_grad():
        out = torch.jit.load(path)(**case.kwargs)
    assert isinstance(out, dict)  # a Hugging Face ModelOutput comes back as a plain dict
    # BERT's mask code computes shapes in Python: the trace is specialised to the example's
    # shapes, so only the example run is compared (export_program covers other batch sizes).
    assert_same(case.expected()[:1], [pytree.tree_leaves(out)])


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.relu(self.fc(x)) + y


def test_positional_and_keyword_examples_are_combined(tmp_path):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    prepared = qfuse.prepare(TwoInputs().eval(), qfuse.QConfig.int8_static(), (x,), {"y": y})
    prepared(x, y=y)
    qmodel = qfuse.convert(prepared)
    traced = qfuse.export_torchscript(qmodel, (x,), tmp_path / "m.ts", example_kwargs={"y": y})
    assert torch.equal(traced(x, y), qmodel(x, y=y))


def test_trace_that_changes_outputs_is_refused_and_not_written(make_case, tmp_path, monkeypatch):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    wrong = torch.jit.trace(nn.Identity(), case.args)  # stands in for a trace that froze a branch
    monkeypatch.setattr(qtorchscript, "_trace", lambda *a: wrong)
    with pytest.raises(qfuse.CaptureError, match="does not reproduce.*export_program"):
        qfuse.export_torchscript(case.qmodel, case.args, tmp_path / "m.ts")
    assert not os.listdir(tmp_path)


def test_failed_write_leaves_the_previous_file(make_case, tmp_path, monkeypatch):
    case = make_case("cnn", qfuse.QConfig.int8_static())
    path = tmp_path / "model.ts"
    path.write_bytes(b"previous version")

    def dies_midway(module, f):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04")  # the start of a zip archive, then the process is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.jit, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        qfuse.export_torchscript(case.qmodel, case.args, path)
    assert path.read_bytes() == b"previous version"
    assert os.listdir(tmp_path) == ["model.ts"]


def test_refuses_a_model_that_is_not_converted(tmp_path):
    x = torch.randn(2, 8)
    prepared = qfuse.prepare(nn.Sequential(nn.Linear(8, 4)), qfuse.QConfig.int8_static(), (x,))
    with pytest.raises(qfuse.QFuseError, match="export_torchscript expects .*qfuse.convert"):
        qfuse.export_torchscript(prepared, (x,), tmp_path / "m.ts")


@pytest.mark.parametrize("config", [qfuse.QConfig.int8_dynamic(), qfuse.QConfig.fp8_dynamic()],
                         ids=["int8_dynamic", "fp8_dynamic"])
@pytest.mark.parametrize("name", ["mlp", "embed"])
def test_dynamic_models_trace_though_their_scales_are_shared(make_case, tmp_path, name, config):
    case = make_case(name, config)
    shared = {n: id(t) for n, t in case.qmodel.named_buffers(remove_duplicate=False)}
    assert len(set(shared.values())) < len(shared)  # a dynamic layer's scale is its weight_scale
    path = tmp_path / "m.ts"
    qfuse.export_torchscript(case.qmodel, case.args, path)
    with torch.no_grad():
        assert torch.equal(torch.jit.load(path)(*case.args), case.qmodel(*case.args))
    # the model is left as it was: its tensors are shared again after the trace
    assert shared == {n: id(t) for n, t in case.qmodel.named_buffers(remove_duplicate=False)}
