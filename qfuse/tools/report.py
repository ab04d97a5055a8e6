"""Sweep results -> a report directory: report.md, results.json, pareto.png, report.html.

One place turns rows into tables (markdown) and machine-readable JSON with the environment the
numbers were measured in (device, versions, commit). Every file is written atomically and the
whole directory is rewritten after each config, so a partial sweep is a valid, smaller report.
"""

from __future__ import annotations

import base64
import html
import json
import os
import platform
import re
import subprocess
import textwrap
import time

import torch

from qfuse.fileio import atomic_savefig, atomic_write_text

COLUMNS = (
    "config",
    "metric",
    "Δ vs fp32",
    "latency",
    "speed-up vs fp32",
    "vs bf16",
    "size",
    "fused / float",
)


def environment() -> dict:
    """Device, library versions and the commit the numbers belong to (``QFUSE_COMMIT`` wins: a
    copy of the tree without ``.git`` cannot tell).

    Example:
        >>> env = environment()
        >>> sorted(k for k in env if k in ("device", "torch", "commit"))
        ['commit', 'device', 'torch']
    """
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False, cwd=here
        ).stdout.strip()
    except OSError:
        commit = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from qfuse._version import __version__

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "backend": "triton kernels (cuda)" if cuda else "torch reference (cpu)",
        "torch": torch.__version__,
        "triton": triton_version,
        "qfuse": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": os.environ.get("QFUSE_COMMIT") or (commit if len(commit) == 40 else "unknown"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        # CPU timings on a shared machine mean little without it
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _size(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _per_mode(values: dict | None, fmt: str, unit: str) -> str:
    return ", ".join(f"{m} {format(v, fmt)}{unit}" for m, v in (values or {}).items())


def _ratio(v: float) -> str:
    """A speed-up: two decimals, or two significant digits below 0.1 (never "0.00×")."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"


def _ratios(values: dict | None) -> str:
    return ", ".join(f"{m} {_ratio(v)}×" for m, v in (values or {}).items())


def table_cells(row: dict) -> list[str]:
    """The report.md cells of one row (also what tests compare with results.json)."""
    label = row["config"]
    if row.get("label") not in (None, row["config"]):
        label += f" ({row['label']})"
    if "error" in row:
        return [label, "error", "", row["error"].replace("|", "/"), "", "", "", ""]
    fused = "" if row.get("fused") is None else f"{row['fused']} / {row['kept_float']}"
    return [
        label,
        f"{row['metric']:.5f}",
        "" if row.get("delta") is None else f"{row['delta'] + 0.0:+.5f}",
        _per_mode(row.get("latency_ms"), ".3f", " ms"),
        _ratios(row.get("speedup")),
        _ratios(row.get("speedup_vs_bf16")),
        _size(row.get("size_bytes")) or row.get("size_error", ""),
        fused,
    ]


def markdown_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    """A GitHub markdown table.

    Example:
        >>> print(markdown_table(["a", "b"], [["1", "2"]]))
        | a | b |
        |---|---|
        | 1 | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def render_markdown(results: dict) -> str:
    env = results["environment"]
    direction = "higher is better" if results["higher_is_better"] else "lower is better"
    cpu = not env["device"].startswith("NVIDIA") and "cpu" in env["device"]
    out = [
        f"# qfuse sweep: {results['recipe']}",
        "",
        results.get("description", ""),
        "",
        f"Device: {env['device']} ({env['backend']}); torch {env['torch']}, triton "
        f"{env['triton']}, qfuse {env['qfuse']}, commit `{env['commit'][:12]}`, {env['date']}"
        + (f", load average {env['load_avg_1min']}" if env.get("load_avg_1min") is not None else "")
        + f". Status: **{results['status']}**.",
        "",
        f"Metric: {results['metric']} ({direction}); Δ vs fp32 is signed so that negative is "
        f"worse. Latency: median of one forward of the example batch after warm-up, per mode; "
        f"speed-up is fp32's (or bf16's, what a user would run instead) time in the same mode "
        f"over this row's.",
    ]
    if cpu:
        out.append(
            "On CPU the fused ops run their PyTorch reference implementation: these latencies "
            "time the reference path (correctness), not the Triton kernels, and rank the "
            "configs by it."
        )
    rounds = {r["timing"] for r in results["rows"] if r.get("timing")}
    if rounds:
        out.append(
            f"Eager latencies: the {', '.join(sorted(rounds))} of every config after all had "
            "run, so that a slow spell of a shared machine slows them alike (a config timed "
            "once moved 20x between sweeps)."
        )
    out += ["", markdown_table(COLUMNS, [table_cells(r) for r in results["rows"]]), ""]
    errs = [(r["config"], r["mode_errors"]) for r in results["rows"] if r.get("mode_errors")]
    for name, errors in errs:
        out.append(f"- {name}: " + "; ".join(f"{m} not timed ({e})" for m, e in errors.items()))
    launches = [
        f"{r['config']}: " + ", ".join(f"{m} {n}" for m, n in r["launches"].items())
        for r in results["rows"]
        if r.get("launches")
    ]
    if launches:
        what = "operators dispatched" if cpu else "GPU kernel launches"
        out += [f"Launches per forward ({what}): " + "; ".join(launches) + ".", ""]
    if "search" in results:
        out += _search_section(results["search"])
    for r in results["rows"]:
        if r.get("search_path"):
            out += ["## best: the search path (no candidate met the budget)", ""]
            out += _path_table(r["search_path"])
    if os.path.exists(results.get("_pareto", "")):
        out += ["![accuracy vs latency](pareto.png)", ""]
    if results.get("_sensitivity"):
        out += [
            "Per-layer sensitivity (from best's auto_fallback):",
            "",
            "![sensitivity](sensitivity.png)",
            "",
        ]
    return "\n".join(out) + "\n"


def _search_section(s: dict) -> list[str]:
    c = s["candidate"]
    out = [
        "## best: the search path",
        "",
        f"Search winner: **{c['label']}** — validation metric {s['metric']:.5f} (float "
        f"{s['baseline']:.5f}, drop {s['drop']:.5f} + margin {s.get('margin', 0.0):.5f} <= "
        f"max-drop {s['max_drop']:g}), "
        f"{s['latency_ms']:.3f} ms eager in the search's own timing (the table re-times every "
        f"row; on a busy machine the two differ by its noise); {s['evaluations']} steps.",
        "",
    ]
    if s.get("margin_rule"):
        rule = s["margin_rule"]
        out += [f"{rule[:1].upper()}{rule[1:]}.", ""]
    if s.get("why"):
        out += [f"Why: {s['why']}.", ""]
    if c["keep_float"]:
        out += [f"Kept float: {', '.join(c['keep_float'])}.", ""]
    if c.get("fp8_layers"):
        out += [f"Moved to fp8: {', '.join(c['fp8_layers'])}.", ""]
    return out + _path_table(s["path"])


def _path_table(path: list[dict]) -> list[str]:
    rows = []
    for st in path:
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        rows.append(
            [
                st["stage"],
                st["candidate"],
                fmt(st["metric"], ".5f"),
                fmt(st["drop"], ".5f"),
                fmt(st.get("margin"), ".5f"),
                fmt(st["latency_ms"], ".3f"),
                "yes" if st["meets"] else "",
                st["note"].replace("|", "/"),
            ]
        )
    header = ["stage", "candidate", "val. metric", "drop", "+ margin", "eager ms", "meets", "note"]
    return [markdown_table(header, rows), ""]


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[int]:
    """Indices of the (latency, metric) points no other point beats on both (lower latency,
    better metric), sorted by latency.

    Example:
        >>> pareto_front([(1.0, 0.9), (2.0, 0.95), (3.0, 0.94), (0.5, 0.5)])
        [3, 0, 1]
    """
    sign = 1.0 if higher_is_better else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -sign * points[i][1]))
    front, best = [], None
    for i in order:
        m = sign * points[i][1]
        if best is None or m > best:
            front.append(i)
            best = m
    return front


def point_label(row: dict) -> str:
    r"""A row's name on the plot: the config, and for ``best`` the configuration the search
    found (wrapped), as the table shows it.

    Example:
        >>> point_label({"config": "best", "label": "int8 static, minmax sym + GPTQ"})
        'best: int8 static, minmax\nsym + GPTQ'
    """
    label = row.get("label")
    if row["config"] != "best" or label in (None, "best"):
        return row["config"]
    return "\n".join(textwrap.wrap(f"best: {label}", 26))


def _pareto_figure(results: dict):
    """The figure ``plot_pareto`` writes, and its point labels (tests read their positions)."""
    rows = [r for r in results["rows"] if "metric" in r and "eager" in r.get("latency_ms", {})]
    if not rows:
        return None, []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = "graph" if all("graph" in r["latency_ms"] for r in rows) else "eager"
    pts = [(r["latency_ms"][mode], r["metric"]) for r in rows]
    front = pareto_front(pts, results["higher_is_better"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="#999999", zorder=2, label="config")
    fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
    ax.plot(fx, fy, "-o", color="#d62728", zorder=3, label="Pareto front")
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.2)  # room for the labels beside the outermost points
    _clamp_metric_axis(ax, results["metric"], [p[1] for p in pts])
    ax.set_xlabel(f"latency, {mode} (ms, log scale) — {results['environment']['device']}")
    ax.set_ylabel(results["metric"])
    ax.set_title(f"qfuse sweep: {results['recipe']}", pad=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    texts = _place_labels(fig, ax, pts, [point_label(r) for r in rows])
    return fig, texts


# Where a label may sit around its point (offsets in points, horizontal alignment), tried in
# order; the first that overlaps no other label, point, the legend or the title wins.
_SPOTS = [(6, 4, "left"), (6, -12, "left"), (-6, 4, "right"), (-6, -12, "right"),
          (6, 16, "left"), (6, -24, "left"), (-6, 16, "right"), (-6, -24, "right"),
          (6, 28, "left"), (6, -36, "left"), (-6, 28, "right"), (-6, -36, "right")]


def _place_labels(fig, ax, pts, labels) -> list:
    """Annotate each point with its label where it collides with nothing drawn so far (on the
    digits sweep three labels sat on one spot; on MiniLM the title covered fp32's); a label
    that fits nowhere takes the spot with the least overlap."""
    renderer = fig.canvas.get_renderer()
    px = [ax.transData.transform(p) for p in pts]
    taken = [ax.title.get_window_extent(renderer)]
    legend = ax.get_legend()
    if legend is not None:
        taken.append(legend.get_window_extent(renderer))
    dots = [_bbox(x - 5, y - 5, x + 5, y + 5) for x, y in px]
    inside = ax.get_window_extent(renderer)
    texts = []
    for i in sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1])):
        best, best_cost = None, None
        for dx, dy, ha in _SPOTS:
            text = ax.annotate(labels[i], pts[i], textcoords="offset points", xytext=(dx, dy),
                               fontsize=8, ha=ha, va="bottom" if dy >= 0 else "top",
                               bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                     "alpha": 0.8})
            box = text.get_window_extent(renderer)
            others = taken + [d for j, d in enumerate(dots) if j != i]
            cost = sum(_overlap(box, o) for o in others) + (
                0.0 if _contains(inside, box) else box.width * box.height)
            if best_cost is None or cost < best_cost:
                if best is not None:
                    best.remove()
                best, best_cost = text, cost
            else:
                text.remove()
            if cost == 0:
                break
        taken.append(best.get_window_extent(renderer))
        texts.append(best)
    return texts


def _bbox(x0, y0, x1, y1):
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _contains(outer, inner) -> bool:
    return (outer.x0 <= inner.x0 and inner.x1 <= outer.x1 and outer.y0 <= inner.y0
            and inner.y1 <= outer.y1)


def plot_pareto(results: dict, path: str) -> str | None:
    """Metric vs eager latency of the rows that have both; the Pareto front highlighted, each
    point named (``best`` with the configuration found) where its name collides with nothing."""
    fig, _ = _pareto_figure(results)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    try:
        return atomic_savefig(fig, path, dpi=120)
    finally:
        plt.close(fig)


def _clamp_metric_axis(ax, metric: str, values: list[float]) -> None:
    """A percentage axis stops at 100 % and a [0, 1] score at 1 (matplotlib's margin ran the
    digits axis to 105 %); the markers on the edge are drawn whole."""
    bound = 100.0 if "%" in metric else 1.0 if all(0.0 <= v <= 1.0 for v in values) else None
    lo, hi = ax.get_ylim()
    if bound is not None and hi > bound >= max(values):
        ax.set_ylim(lo, bound)
        for artist in ax.collections + ax.lines:
            artist.set_clip_on(False)


_INLINE = (
    (re.compile(r"\*\*(.+?)\*\*"), r"<b>\1</b>"),
    (re.compile(r"`(.+?)`"), r"<code>\1</code>"),
)


def _inline(text: str) -> str:
    """Escaped text with markdown's **bold** and `code` as HTML.

    Example:
        >>> _inline("Status: **complete** <ok> `x`")
        'Status: <b>complete</b> &lt;ok&gt; <code>x</code>'
    """
    out = html.escape(text)
    for pattern, repl in _INLINE:
        out = pattern.sub(repl, out)
    return out


def _html(markdown: str, out: str) -> str:
    """A self-contained page: the report text, plots embedded as data URIs."""
    body = []
    for line in markdown.splitlines():
        if line.startswith("![") and "](" in line:
            name = line.split("](", 1)[1].rstrip(")")
            with open(os.path.join(out, name), "rb") as f:
                data = base64.b64encode(f.read()).decode()
            body.append(f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= {"-"}:
                continue
            body.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line.lstrip('# '))}</h{level}>")
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    text = "\n".join(body).replace("</tr>\n<p>", "</tr></table>\n<p>")
    page, in_table = [], False
    for part in text.split("\n"):
        if part.startswith("<tr>") and not in_table:
            page.append("<table border=1 cellpadding=4 style='border-collapse:collapse'>")
            in_table = True
        elif not part.startswith("<tr>") and in_table:
            page.append("</table>")
            in_table = False
        page.append(part)
    if in_table:
        page.append("</table>")
    return "<!doctype html><meta charset=utf-8><title>qfuse sweep</title>\n" + "\n".join(page)


def write_report(out: str | os.PathLike, results: dict, sensitivity=None) -> dict:
    """Write report.md, results.json, pareto.png (and sensitivity.png, report.html) to ``out``."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    results.setdefault("environment", environment())
    pareto = plot_pareto(results, os.path.join(out, "pareto.png"))
    results["_pareto"] = pareto or ""
    if sensitivity is not None and sensitivity.rows:
        import matplotlib.pyplot as plt

        sensitivity.plot(os.path.join(out, "sensitivity.png"))
        plt.close("all")
        results["_sensitivity"] = True
    markdown = render_markdown(results)
    public = {k: v for k, v in results.items() if not k.startswith("_")}
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(public, indent=1, default=str))
    atomic_write_text(os.path.join(out, "report.md"), markdown)
    atomic_write_text(os.path.join(out, "report.html"), _html(markdown, out))
    return public
