"""qfuse.export_program (.pt2, dynamic batch, fresh process) and torch.compile(fullgraph=True)."""

import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.export.program import static_batch_inputs
from tests.export.cases import (
    CONFIGS,
    MINILM_CONFIGS,
    SMALL,
    FreshJob,
    accepted_cases,
    assert_same,
    check_in_fresh_process,
    expected_leaves,
    on_cuda,
)


def test_fresh_process_runs_every_model_at_another_batch_size(make_case, tmp_path):
    jobs = []
    for i, case in enumerate(accepted_cases(make_case)):
        path = str(tmp_path / f"{case.name}-{i}.pt2")
        program = qfuse.export_program(case.qmodel, case.args, path)
        assert static_batch_inputs(program) == [], case.name
        label = f"{case.name} {case.config}"
        jobs.append(FreshJob(label, "program", path, case.runs(), case.expected()))
    # MiniLM rides in the same process. Its output is a Hugging Face ModelOutput, a class named
    # in the program's output spec, so its module must be imported before torch.export.load.
    for i, case in enumerate(accepted_cases(make_case, ["minilm"], MINILM_CONFIGS)):
        path = str(tmp_path / f"minilm-{i}.pt2")
        qfuse.export_program(case.qmodel, (), path, example_kwargs=case.kwargs)
        imports = ("transformers.modeling_outputs",)
        label = f"minilm {case.config}"
        jobs.append(FreshJob(label, "program", path, case.runs(), case.expected(), imports))
    check_in_fresh_process(jobs, tmp_path)


@pytest.mark.gpu
def test_cuda_models_run_in_a_fresh_process(make_case, tmp_path):
    jobs = []
    for i, case in enumerate(accepted_cases(make_case)):
        qmodel, runs = on_cuda(case)
        path = str(tmp_path / f"{case.name}-{i}.pt2")
        qfuse.export_program(qmodel, runs[0][0], path)
        label = f"{case.name} {case.config} cuda"
        jobs.append(FreshJob(label, "program", path, runs, expected_leaves(qmodel, runs)))
    check_in_fresh_process(jobs, tmp_path)


# torch.compile uses backend="aot_eager": it traces the same fullgraph through dynamo and AOT
# autograd (what fullgraph=True checks) but skips inductor's C++ codegen, which took 21.8 s for
# the small CNN alone on this CPU against 0.6 s for aot_eager.
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", SMALL)
def test_torch_compile_fullgraph_matches(make_case, name, config):
    case = make_case(name, config)
    compiled = torch.compile(case.qmodel, fullgraph=True, backend="aot_eager")
    assert_same(case.expected(), expected_leaves(compiled, case.runs()))


def test_minilm_torch_compile_fullgraph_matches(make_case):
    case = make_case("minilm", qfuse.QConfig.int8_static())
    compiled = torch.compile(case.qmodel, fullgraph=True, backend="aot_eager")
    # expected_leaves runs under no_grad: MiniLM keeps float parameters that require grad
    # (LayerNorm, embeddings), and with grad enabled AOT autograd would trace a backward through
    # the qfuse ops, which have no autograd formula.
    assert_same(case.expected()[:1], expected_leaves(compiled, case.runs()[:1]))


def test_example_batch_of_one_warns_that_the_batch_is_fixed(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    with pytest.warns(UserWarning, match="batch dimension of x was specialised"):
        program = qfuse.export_program(case.qmodel, (case.args[0][:1],), tmp_path / "m.pt2")
    assert static_batch_inputs(program) == ["x"]


def test_impossible_dynamic_shapes_are_a_capture_error(make_case, tmp_path):
    case = make_case("mlp", qfuse.QConfig.int8_static())
    features = torch.export.Dim("features")  # the Linear fixes the feature size at 32
    with pytest.raises(qfuse.CaptureError, match="torch.export failed"):
        qfuse.export_program(case.qmodel, case.args, tmp_path / "m.pt2", {"x": {2: features}})
    assert not os.listdir(tmp_path)


def test_failed_write_leaves_no_file(make_case, tmp_path, monkeypatch):
    case = make_case("cnn", qfuse.QConfig.int8_static())

    def dies_midway(program, f):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        qfuse.export_program(case.qmodel, case.args, tmp_path / "model.pt2")
    assert not os.listdir(tmp_path)


def test_refuses_a_model_that_is_not_converted(tmp_path):
    x = torch.randn(2, 8)
    prepared = qfuse.prepare(nn.Sequential(nn.Linear(8, 4)), qfuse.QConfig.int8_static(), (x,))
    with pytest.raises(qfuse.QFuseError, match="export_program expects .*qfuse.convert"):
        qfuse.export_program(prepared, (x,), tmp_path / "m.pt2")
