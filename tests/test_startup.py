"""Start-up and noise: ``import qfuse`` costs little over ``import torch`` (the flows, ops,
Triton, transformers and ONNX load on first use), ``python -m qfuse`` alone prints its help, and
a failed capture says why without printing torch's partial FX graph."""

import logging
import statistics
import subprocess
import sys

import pytest
import torch

import qfuse

HEAVY = ("triton", "transformers", "onnx", "torch._inductor", "qfuse.ops", "qfuse.flows.convert")


def _fresh(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True,
                          check=True)


def _own_import_seconds() -> float:
    """``import qfuse``'s own time in a fresh process: its cumulative import time less torch's
    (``-X importtime``, so a loaded machine slows both alike)."""
    cumulative = {}
    for line in _fresh("import qfuse", "-X", "importtime").stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip() in ("qfuse", "torch"):
            cumulative.setdefault(parts[2].strip(), int(parts[1]) / 1e6)
    return cumulative["qfuse"] - cumulative["torch"]


def test_import_qfuse_adds_little_to_import_torch():
    """Measured on the 2-core CI machine: 0.03 s over torch's 2 s (it was 2.0 s: the ops' Triton
    and Inductor, torch.export, transformers' quantizer registry)."""
    own = statistics.median(_own_import_seconds() for _ in range(3))
    assert own < 0.6, f"import qfuse takes {own:.2f} s more than import torch"


def test_import_qfuse_loads_nothing_heavy_and_every_name_on_use():
    code = ("import sys, torch, qfuse; print(sorted(m for m in sys.modules if m in {heavy!r}));"
            "print(*[getattr(torch.ops.qfuse, op).default for op in {ops!r}]);"
            "from qfuse import convert, Backend, export_onnx;"
            "print(qfuse.export.onnx.session_options.__name__)")
    ops = ["attention_quant", "qlinear_launch", "layer_norm_quant"]  # what a program may call
    lines = _fresh(code.format(heavy=set(HEAVY), ops=ops)).stdout.splitlines()
    assert lines[0] == "[]", lines[0]  # loaded by nothing, until the first op is looked up:
    assert lines[1] == " ".join(f"qfuse.{op}.default" for op in ops)  # torch.export.load's way
    assert lines[2] == "session_options"
    assert set(qfuse.__all__) <= set(dir(qfuse))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qfuse.nope  # noqa: B018


def test_python_m_qfuse_alone_prints_help():
    result = subprocess.run([sys.executable, "-m", "qfuse"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: qfuse") and "sweep" in result.stdout


class _DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x


def test_a_failed_capture_prints_no_graph_unless_asked(capfd, caplog):
    with pytest.raises(qfuse.CaptureError, match="could not capture _DataDependent"):
        qfuse.prepare(_DataDependent(), qfuse.QConfig.int8_static(), (torch.randn(2, 4),))
    assert "def forward" not in capfd.readouterr().err
    with caplog.at_level(logging.DEBUG, logger="qfuse.pipeline.capture"), \
            pytest.raises(qfuse.CaptureError):
        qfuse.prepare(_DataDependent(), qfuse.QConfig.int8_static(), (torch.randn(2, 4),))
    assert "def forward" in caplog.text  # asked for: the partial graph, at DEBUG
