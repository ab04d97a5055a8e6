"""bench/models/bench_models.py's resume logic (the timing itself needs CUDA): a second call at
the same commit runs only what the first left, and rows from other code never mix in."""

import json

from bench import harness
from bench.models import bench_models


def _write(path, commit, rows):
    path.write_text(json.dumps({"commit": commit, "rows": rows}))


def test_resume_keeps_timed_rows_of_the_same_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("QFUSE_COMMIT", "abc1234")
    out = tmp_path / "models.json"
    timed = dict(model="bert-base", batch=32, impl="bf16", mode="graph", median_us=1.0)
    failed = dict(model="bert-base", batch=32, impl="qfuse_int8", mode="graph", error="x")
    _write(out, "abc1234", [timed, failed])
    rows = bench_models.resumed_rows(str(out))
    assert rows == [timed]  # a failed row is run again
    _write(out, "fff0000", [timed])
    assert bench_models.resumed_rows(str(out)) == []
    assert bench_models.resumed_rows(str(tmp_path / "missing.json")) == []
    assert harness.environment()["commit"] == "abc1234"


def test_pending_counts_every_mode_of_an_impl():
    done = {("minilm-l6", 1, "bf16", "eager"), ("minilm-l6", 1, "bf16", "compile")}
    assert bench_models.pending(done, "minilm-l6", 1, "bf16")  # graph left
    done.add(("minilm-l6", 1, "bf16", "graph"))
    assert not bench_models.pending(done, "minilm-l6", 1, "bf16")
    assert bench_models.modes_of("torchao_int8") == ("compile", "graph")
    assert bench_models.modes_of("fp32") == ("eager",)


def test_launch_modes_counts_fused_linears():
    import torch

    from qfuse.nn import QLinear

    lin = QLinear.from_float(torch.randn(8, 16), None, x_scale=torch.tensor(0.1),
                             x_zero_point=None)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
    assert bench_models.launch_modes(model) == {"cached launch": 1}  # one module, listed once
    lin._launch_cache["plain"] = "plain launch (direct launch failed: X)"
    assert bench_models.launch_modes(torch.nn.Sequential(lin)) == {
        "plain launch (direct launch failed: X)": 1}


def test_committed_results_are_unambiguous():
    # A reader (or a script) that keys rows by (model, batch, seq, impl, mode) across one GPU's
    # current files must not be able to pair a qfuse row with a bf16 row of another run: each
    # key lives in one file, and each quantized row's bf16 baseline is in that same file.
    from pathlib import Path

    current = Path(__file__).parent.parent / "bench" / "results" / "current"
    files = sorted(current.glob("*/models_*.json"))
    assert files, "no current bench_models results"
    seen: dict[tuple, str] = {}
    for f in files:
        rows = [r for r in json.loads(f.read_text())["rows"] if "model" in r and "median_us" in r]
        keys = {(f.parent.name, r["model"], r["batch"], r.get("seq"), r["impl"], r["mode"])
                for r in rows}
        name = f"{f.parent.name}/{f.name}"
        for key in keys:
            assert key not in seen, f"{key} in both {seen[key]} and {name}"
            seen[key] = name
        for gpu, model, batch, seq, impl, mode in keys:
            if impl.startswith(("qfuse", "torchao")):
                assert (gpu, model, batch, seq, "bf16", mode) in keys, (
                    f"{name}: {impl} {mode} lacks bf16")
