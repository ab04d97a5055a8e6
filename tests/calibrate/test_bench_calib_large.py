"""CPU smoke run of bench/calib_large.py at tiny size (the device runs the 7B shape)."""

import json
import sys

from bench import calib_large


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
