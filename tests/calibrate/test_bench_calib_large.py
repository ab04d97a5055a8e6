"""CPU smoke run of bench/models/calib_large.py at tiny size (the device runs the 7B shape)."""

import json
import sys

from bench.models import calib_large


def test_tiny_sequential_run_writes_json_and_table(tmp_path, monkeypatch, capsys):
    argv = [
        "calib_large.py",
        "--tiny",
        "--device",
        "cpu",
        "--samples",
        "4",
        "--tokens",
        "8",
        "--batch-size",
        "2",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    calib_large.main()
    (path,) = tmp_path.glob("calib_large_sequential_1gpu_2l.json")
    report = json.loads(path.read_text())
    assert report["shape"]["layers"] == 2 and report["samples"] == 4
    assert report["results"]["sequential"]["wall_s"] > 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-2].split()[:2] == ["mode", "wall"] and table[-1].startswith("sequential")


def test_tiny_run_from_shards_reports_the_time_split(tmp_path, monkeypatch, capsys):
    shards = str(tmp_path / "llama")
    monkeypatch.setattr(sys, "argv", ["calib_large.py", "--tiny", "--write-shards", shards])
    calib_large.main()
    small = ["--samples", "4", "--tokens", "8", "--batch-size", "2", "--out", str(tmp_path)]
    argv = ["calib_large.py", "--tiny", "--device", "cpu", "--from-shards", shards, *small]
    monkeypatch.setattr(sys, "argv", argv)
    calib_large.main()
    (path,) = tmp_path.glob("calib_large_sequential_1gpu_2l_shards.json")
    run = json.loads(path.read_text())["results"]["sequential_shards"]
    assert [s["name"] for s in run["stages"]] == [
        "prefix",
        "model.layers.0",
        "model.layers.1",
        "tail",
    ]
    for stage in run["stages"]:  # the phases add up to the stage's time
        parts = sum(stage[k] for k in ("forward", "gptq", "sync", "load", "other"))
        assert abs(parts - stage["total"]) < 1e-6 and stage["forward"] > 0
    assert sum(s["load"] for s in run["stages"]) > 0
    assert abs(run["split_s"]["setup"] + run["split_s"]["total"] - run["wall_s"]) < 0.1
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-2].split()[:2] == ["mode", "wall"] and table[-1].startswith("sequential_shards")
