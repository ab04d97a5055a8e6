"""One current result per question: bench/results/current/ holds it, README.md and
docs/results.md render it (bench/tables.py), and nothing current points into bench/history/."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tables

ROOT = Path(__file__).resolve().parents[1]


def test_rendered_tables_are_current():
    stale = tables.stale()
    assert not stale, f"stale results tables {stale}: run `python -m bench.tables`"


def test_check_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "bench.tables", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_every_current_file_names_its_commit_device_and_command():
    results = tables.load()
    assert {r.gpu for r in results} == set(tables.GPUS)
    assert tables.problems(results) == []
    for r in results:
        d = r.data
        assert isinstance(d["commit"], str) and len(d["commit"]) >= 7, r.path
        assert isinstance(d["versions"], dict) and "torch" in d["versions"], r.path
        assert "bench/history" not in d["command"], r.path
        source = d.get("source")
        if source:
            assert (ROOT / source.split()[0]).exists(), f"{r.path}: source {source} is missing"


def test_models_rows_keep_their_keys():
    # Readers pair rows by (model, batch, seq, impl, mode) across the models files: every timed
    # row carries those keys, each key lives in one file, and each quantized row has its bf16
    # baseline in the same file.
    seen: dict[tuple, str] = {}
    files = [r for r in tables.load() if r.name.startswith("models_")]
    assert files
    for r in files:
        rows = [row for row in r.data["rows"] if "median_us" in row]
        keys = {(row["model"], row["batch"], row["seq"], row["impl"], row["mode"]) for row in rows}
        for key in keys:
            assert key not in seen, f"{key} in both {seen[key]} and {r.path}"
            seen[key] = r.path
            if key[3].startswith("qfuse"):
                assert (*key[:3], "bf16", key[4]) in keys, f"{r.path}: {key} lacks bf16"


@pytest.mark.parametrize(
    "page",
    ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))],
)
def test_nothing_current_points_into_history(page):
    assert "bench/history" not in (ROOT / page).read_text()


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "bench" / "results" / "current", tmp_path / "bench/results/current")
    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/results.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_changed_result_names_its_stale_blocks(tmp_path):
    root = _copy(tmp_path)
    path = root / "bench/results/current/h200/models_bert-base_b32_s128.json"
    data = json.loads(path.read_text())
    next(row for row in data["rows"] if row["impl"] == "qfuse_int8")["median_us"] = 1000.0
    path.write_text(json.dumps(data))
    assert tables.stale(root) == ["README.md: gpu", "docs/results.md: h200"]
    for file, (_, new) in tables.render(root).items():
        (root / file).write_text(new)
    assert tables.stale(root) == []
    assert "1000 µs, **1.82×**" in (root / "README.md").read_text()


def test_missing_markers_and_fields_are_named(tmp_path):
    root = _copy(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("<!-- results:end cpu -->", ""))
    assert "README.md: cpu (no markers)" in tables.stale(root)
    with pytest.raises(ValueError, match="README.md: no '<!-- results:begin cpu -->'"):
        tables.render(root)
    result = tables.Result("cpu", "x", {"title": "t", "device": "cpu", "rows": [{}]})
    assert tables.problems([result]) == ["cpu/x.json: missing commit, date, versions, command"]


def test_cells():
    assert tables.fmt(0.0271, "pct") == "2.7%"
    assert tables.fmt(1.2916, "x") == "1.29×"
    assert tables.fmt(0.0113, "+.2f%") == "+0.01%"
    assert tables.fmt(None) == "–" and tables.fmt(True) == "yes"
    assert tables.get({"a": {"b": 3}}, "a.c|a.b") == 3
    assert tables.table(["a|b"], [["x"]]) == "| a\\|b |\n|---|\n| x |"
