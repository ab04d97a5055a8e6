import torch

import qfuse
from qfuse.analysis.summary import COLUMNS
from tests.models import MLPBlock


def test_summary_rows_are_data_and_render_as_table():
    model = MLPBlock().eval()
    x = torch.randn(4, 32)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    s = qfuse.summary(qfuse.convert(prepared))
    assert [r["name"] for r in s.rows] == ["up", "down"]
    assert all(set(r) == set(COLUMNS) for r in s.rows)
    up, down = s.rows
    assert up["pattern"] == "Linear→GELU" and up["output"] == "int8 to down"
    assert down["pattern"] == "Linear→residual" and down["input"] == "int8 from up"
    assert up["kernel"] == "torch reference (cpu)"
    text = str(s)
    assert text.splitlines()[0].split()[:3] == ["name", "pattern", "precision"]
    assert "Linear→GELU" in text


def test_summary_reports_the_backend_that_will_run():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    prepared(torch.randn(4, 32))
    qmodel = qfuse.convert(prepared)
    with qfuse.use_backend("triton"):
        assert qfuse.summary(qmodel).rows[0]["kernel"] == "triton qgemm (cpu)"


def test_summary_labels_fp8_and_dynamic_layers_truthfully():
    x = torch.randn(4, 32)
    expect = {
        "fp8_static": ("fp8_e4m3", "float → fp8_e4m3 in prologue", "fp8_e4m3 to down"),
        "int8_dynamic": ("int8", "float → int8 per token (dynamic)", "float32"),
    }
    for preset, (precision, source, sink) in expect.items():
        prepared = qfuse.prepare(MLPBlock().eval(), getattr(qfuse.QConfig, preset)(), (x,))
        prepared(x)
        up = qfuse.summary(qfuse.convert(prepared)).rows[0]
        assert (up["precision"], up["input"], up["output"]) == (precision, source, sink), preset
        text = str(qfuse.summary(qfuse.convert(prepared))).splitlines()
        assert text[0].split()[:3] == ["name", "pattern", "precision"]
        assert any(line.startswith("up ") and source in line for line in text[2:])
