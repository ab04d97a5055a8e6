"""Render the results tables of README.md and docs/results.md from bench/results/current/.

    python -m bench.tables            # rewrite every block from the current files
    python -m bench.tables --check    # exit 1 and name each stale block (what the tests run)

One file per question: ``bench/results/current/<gpu>/<workload>.json`` (gpu: h200, h100, cpu),
overwritten when the question is measured again. Each file names what produced it::

    {"title": ..., "question": ..., "device": ..., "commit": ..., "date": ...,
     "versions": {"torch": ..., ...}, "command": "how to reproduce it",
     "source": "where the rows were copied from (optional)", "notes": [...],
     "columns": [...], "where": {...}, "pivot": {...}, "readme": [...], "rows": [...]}

``columns`` picks the docs table's columns (``{"title", "key", "fmt"}``, or a ratio against a
baseline row: ``{"title", "ratio": key, "baseline": {match}, "same": [keys]}``); without it every
scalar field is a column. ``where`` keeps only rows whose fields take the listed values;
``pivot`` draws one field against two others. ``readme`` entries put rows into README's tables
(``gpu``: speed-up over bf16, ``cpu``: against torch and onnxruntime, ``accuracy``: real weights).

The rendered text sits between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->``
markers. Plain json and markdown: no torch, nothing else from bench/.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CURRENT = ROOT / "bench" / "results" / "current"
GPUS = {"h200": "H200", "h100": "H100", "cpu": "CPU"}  # folder -> label, in page order
REQUIRED = ("title", "device", "commit", "date", "versions", "command", "rows")
COMMAND = "python -m bench.tables"


@dataclass(frozen=True)
class Result:
    gpu: str  # the folder: h200, h100, cpu
    name: str  # the workload: the file's stem
    data: dict

    @property
    def path(self) -> str:
        return f"{self.gpu}/{self.name}.json"


def load(root: Path = CURRENT) -> list[Result]:
    """Every current file, in page order (GPU, then name)."""
    results = []
    for gpu in GPUS:
        for path in sorted((root / gpu).glob("*.json")):
            results.append(Result(gpu, path.stem, json.loads(path.read_text())))
    strays = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.json")
        if p.parent.name not in GPUS or p.parent.parent != root
    )
    if strays:
        raise ValueError(f"current results outside {sorted(GPUS)}/: {strays}")
    return results


def problems(results: list[Result]) -> list[str]:
    """What a current file lacks: every one names its commit, device, command and rows."""
    out = []
    for r in results:
        missing = [k for k in REQUIRED if not r.data.get(k)]
        if missing:
            out.append(f"{r.path}: missing {', '.join(missing)}")
    return out


# ---- cells ------------------------------------------------------------------------------------
def get(row: dict, key: str):
    """A field by dotted path; ``a|b`` takes the first that is present."""
    for alternative in key.split("|"):
        value = row
        for part in alternative.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return value
    return None


def fmt(value, spec: str | None = None) -> str:
    """``pct``: a fraction as percent; ``x``: a ratio; ``<spec>%``: a percent value; else format."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value) if value else "–"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) if value else "–"
    if not isinstance(value, (int, float)):
        return str(value)
    if spec == "pct":
        return f"{value * 100:.1f}%"
    if spec == "x":
        return f"{value:.2f}×"
    if spec and spec.endswith("%"):
        return format(value, spec[:-1]) + "%"
    if spec:
        return format(value, spec)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def duration(value: float, unit: str) -> str:
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def matches(row: dict, match: dict) -> bool:
    return all(get(row, k) == v for k, v in match.items())


def find(result: Result, match: dict) -> dict:
    found = [row for row in result.data["rows"] if matches(row, match)]
    if len(found) != 1:
        raise ValueError(f"{result.path}: {len(found)} rows match {match}, want 1")
    return found[0]


# ---- docs/results.md --------------------------------------------------------------------------
def _ratio(column: dict, row: dict, rows: list[dict]) -> str:
    key = column["ratio"]
    same = {k: get(row, k) for k in column.get("same", [])}
    base = [r for r in rows if matches(r, {**same, **column["baseline"]})]
    if len(base) != 1 or not get(row, key) or not get(base[0], key):
        return "–"
    return fmt(get(base[0], key) / get(row, key), "x")


def rows_table(data: dict) -> str:
    rows = data["rows"]
    shown = [
        r for r in rows if all(get(r, k) in allowed for k, allowed in data.get("where", {}).items())
    ]
    if "pivot" in data:
        p = data["pivot"]
        keys = list(dict.fromkeys(get(r, p["row"]) for r in shown))
        cols = list(dict.fromkeys(get(r, p["col"]) for r in shown))
        by = {(get(r, p["row"]), get(r, p["col"])): get(r, p["value"]) for r in shown}
        body = [[fmt(k)] + [fmt(by.get((k, c)), p.get("fmt")) for c in cols] for k in keys]
        return table([p["row"]] + [fmt(c) for c in cols], body)
    columns = data.get("columns") or [
        {"title": k, "key": k}
        for k in dict.fromkeys(
            k for r in shown for k, v in r.items() if not isinstance(v, (dict, list))
        )
    ]
    body = [
        [
            _ratio(c, r, rows) if "ratio" in c else fmt(get(r, c["key"]), c.get("fmt"))
            for c in columns
        ]
        for r in shown
    ]
    return table([c["title"] for c in columns], body)


def section(result: Result) -> str:
    d = result.data
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items())
    lines = [f"### {d['title']}", ""]
    if d.get("question"):
        lines += [f"*{d['question']}*", ""]
    lines += [
        f"[`{result.path}`](../bench/results/current/{result.path}) · {d['device']} · "
        f"commit `{d['commit']}` · {d['date']} · {versions}",
        "",
        f"Reproduce: `{d['command']}`",
        "",
    ]
    lines += [f"{note}\n" for note in d.get("notes", [])]
    lines.append(rows_table(d))
    return "\n".join(lines)


def results_page(gpu: str) -> Callable[[list[Result]], str]:
    def render(results: list[Result]) -> str:
        sections = [section(r) for r in results if r.gpu == gpu]
        return "\n\n".join(sections) if sections else "No current results."

    return render


# ---- README.md --------------------------------------------------------------------------------
def entries(results: list[Result], name: str) -> list[tuple[Result, dict]]:
    found = [(r, e) for r in results for e in r.data.get("readme", []) if e["table"] == name]
    return sorted(found, key=lambda re_: (re_[1]["order"], list(GPUS).index(re_[0].gpu)))


def gpu_table(results: list[Result]) -> str:
    body = []
    for r, e in entries(results, "gpu"):
        rows = [find(r, e[k]) for k in ("baseline", "int8", "fp8")]
        base = get(rows[0], e["time"])
        line = [e["model"], e["workload"], GPUS[r.gpu], duration(base, "µs")]
        for q in rows[1:]:
            t = get(q, e["time"])
            line.append(f"{duration(t, 'µs')}, **{fmt(base / t, 'x')}**")
        errors = [fmt(get(q, e["error"]), "pct") for q in rows] if e.get("error") else ["–"]
        body.append(line + [" / ".join(errors)])
    return table(
        [
            "model",
            "workload",
            "GPU",
            "bf16 compiled + graphed",
            "qfuse int8",
            "qfuse fp8",
            "error vs fp32: bf16 / int8 / fp8",
        ],
        body,
    )


def cpu_table(results: list[Result]) -> str:
    body = []
    for r, e in entries(results, "cpu"):
        t = {k: get(find(r, e[k]), e["time"]) for k in ("torch", "qfuse", "ort", "ort_int8")}
        body.append(
            [
                e["model"],
                duration(t["torch"], "ms"),
                f"{duration(t['qfuse'], 'ms')}, {fmt(t['torch'] / t['qfuse'], 'x')}",
                duration(t["ort"], "ms"),
                f"{duration(t['ort_int8'], 'ms')}, {fmt(t['ort'] / t['ort_int8'], 'x')}",
            ]
        )
    return table(
        [
            "model (one CPU thread)",
            "torch fp32",
            "qfuse int8 (CPU reference), × torch",
            "onnxruntime fp32",
            "onnxruntime int8 (qfuse's ONNX export), × onnxruntime",
        ],
        body,
    )


def accuracy_table(results: list[Result]) -> str:
    body = [
        [
            e["model"],
            e["config"],
            f"{fmt(get(find(r, e['match']), e['key']), e.get('fmt'))} {e['metric']}",
        ]
        for r, e in entries(results, "accuracy")
    ]
    return table(["model (real weights)", "config", "result"], body)


BLOCKS: dict[tuple[str, str], Callable[[list[Result]], str]] = {
    ("README.md", "cpu"): cpu_table,
    ("README.md", "gpu"): gpu_table,
    ("README.md", "accuracy"): accuracy_table,
    **{("docs/results.md", gpu): results_page(gpu) for gpu in GPUS},
}


# ---- blocks -----------------------------------------------------------------------------------
def _block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- results:begin {re.escape(name)} -->\n)(.*?)"
        rf"(<!-- results:end {re.escape(name)} -->)",
        re.S,
    )


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with block ``name`` holding ``body``; ValueError when the markers are missing."""
    pattern = _block(name)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- results:begin {name} -->' ... end markers")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text, 1)


def render(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """``{file: (old text, new text)}`` for every file holding blocks."""
    results = load(root / CURRENT.relative_to(ROOT))
    out: dict[str, tuple[str, str]] = {}
    for (file, name), renderer in BLOCKS.items():
        old = out[file][0] if file in out else (root / file).read_text()
        new = out[file][1] if file in out else old
        try:
            new = replace_block(new, name, renderer(results))
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None
        out[file] = (old, new)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The blocks whose text differs from what the current files render, as 'file: name'."""
    results = load(root / CURRENT.relative_to(ROOT))
    names = []
    for (file, name), renderer in BLOCKS.items():
        text = (root / file).read_text()
        match = _block(name).search(text)
        if match is None:
            names.append(f"{file}: {name} (no markers)")
        elif match.group(2).rstrip("\n") != renderer(results).rstrip("\n"):
            names.append(f"{file}: {name}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming each stale block"
    )
    args = parser.parse_args(argv)
    bad = problems(load())
    for line in bad:
        print(f"incomplete: {line}", file=sys.stderr)
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: {name} (run `{COMMAND}`)", file=sys.stderr)
        return 1 if names or bad else 0
    for file, (old, new) in render().items():
        if new != old:
            (ROOT / file).write_text(new)
            print(f"rewrote {file}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
