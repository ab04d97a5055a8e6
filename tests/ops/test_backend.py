import pytest
import torch

import qfuse
from qfuse.ops import backend
from qfuse.ops.backend import Backend, read_environment, requested_backend, resolve_backend


@pytest.fixture(autouse=True)
def _keep_the_process_backend():
    """QFUSE_BACKEND is read once per process: these tests read it again, and leave what they
    read behind for no other test."""
    kept = backend._from_environment
    yield
    backend._from_environment = kept


def test_auto_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("QFUSE_BACKEND", raising=False)
    read_environment()
    assert resolve_backend(torch.device("cpu")) is Backend.REFERENCE


def test_environment_variable_forces_backend(monkeypatch):
    monkeypatch.setenv("QFUSE_BACKEND", "triton")
    monkeypatch.setattr("qfuse.ops.backend.triton_interpreted", lambda: True)
    assert read_environment() is Backend.TRITON
    assert requested_backend() is Backend.TRITON
    assert resolve_backend(torch.device("cpu")) is Backend.TRITON
    monkeypatch.setenv("QFUSE_BACKEND", "reference")
    assert resolve_backend(torch.device("cuda")) is Backend.TRITON  # read once per process
    read_environment()
    assert resolve_backend(torch.device("cuda")) is Backend.REFERENCE


def test_the_first_call_reads_the_environment(monkeypatch):
    monkeypatch.setenv("QFUSE_BACKEND", " Reference ")
    monkeypatch.setattr(backend, "_from_environment", None)
    assert requested_backend() is Backend.REFERENCE


def test_unknown_backend_name_is_an_error(monkeypatch):
    monkeypatch.setenv("QFUSE_BACKEND", "cuda-graphs")
    with pytest.raises(qfuse.BackendError, match="auto, triton, reference"):
        read_environment()


def test_triton_without_interpreter_on_cpu_is_an_error(monkeypatch):
    monkeypatch.setattr("qfuse.ops.backend.triton_interpreted", lambda: False)
    with qfuse.use_backend("triton"), pytest.raises(qfuse.BackendError, match="TRITON_INTERPRET"):
        resolve_backend(torch.device("cpu"))


def test_forcing_triton_for_an_op_without_kernel_is_an_error():
    with qfuse.use_backend("triton"), pytest.raises(qfuse.BackendError, match="no Triton kernel"):
        resolve_backend(torch.device("cpu"), has_triton_kernel=False)
