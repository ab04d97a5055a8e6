"""``qfuse`` on the command line: ``qfuse sweep --recipe digits --configs ... --out reports/X``,
``qfuse best --recipe llm`` (the search alone, beside fp32; also ``python -m qfuse``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from qfuse.errors import QFuseError


def _sweep_parser(sub):
    return sub.add_parser(
        "sweep",
        help="accuracy-vs-speed sweep of quantization configs on a recipe",
        description="Calibrate, convert, evaluate and time each config of a recipe; write "
        "report.md, results.json, pareto.png and report.html to --out.",
        epilog="Exit status: 0 when every config ran, 1 when any config failed (its row in the "
        "report says why), 2 for bad arguments.",
    )


def _best_parser(sub):
    return sub.add_parser(
        "best",
        help="the fastest config within a metric budget (qfuse sweep --configs fp32,best)",
        description="Search the recipe's space for the fastest config whose validation metric "
        "drop is within --max-drop, measure it and fp32 on held-out data, and say why it won "
        "(and which candidates were over the budget). Writes the sweep's report files to --out.",
        epilog="Exit status: 0 when a config met the budget, 1 when none did, 2 for bad "
        "arguments.",
    )


def _sweep_arguments(p, configs: str | None = None) -> None:
    """The sweep's options: their defaults load the sweep (the flows, the ops), so only a
    command line that runs ``qfuse sweep`` builds them (``qfuse --help`` stays instant)."""
    from qfuse.tools.recipes import DEFAULT_RECIPE, recipe_names
    from qfuse.tools.sweep import CONFIGS
    from qfuse.tools.timing import MODES

    p.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"{' | '.join(recipe_names())} | path/to/module.py (defines sweep_spec()); "
        f"default {DEFAULT_RECIPE}",
    )
    p.add_argument(
        "--configs",
        default=configs or ",".join(CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)} (default: {configs or 'all'})",
    )
    p.add_argument("--out", default=None, help="report directory (default reports/RECIPE)")
    p.add_argument(
        "--max-drop",
        type=float,
        default=None,
        help="largest metric drop vs fp32 that 'best' may accept, in the recipe's metric units "
        "(default: the recipe's default_max_drop)",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="'best': a candidate meets --max-drop when its drop plus the noise margin, this "
        "one-sided confidence bound of its per-window differences vs fp32, does (recipes whose "
        "validation metric is per window, e.g. llm); 0.5 for no margin (default 0.95)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument(
        "--modes", default=",".join(MODES), help="latency modes on CUDA (CPU times eager only)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per median on CPU")
    p.add_argument("--reduced", action="store_true", help="the recipe's small setting (CI)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qfuse`` console script. Returns the exit status.

    Example:
        >>> main(["sweep", "--recipe", "no_such_recipe", "--quiet"])
        2
        >>> main([])  # doctest: +ELLIPSIS
        usage: qfuse [-h] [--version] {sweep,best} ...
        ...
        0
    """
    from qfuse._version import __version__

    parser = argparse.ArgumentParser(
        prog="qfuse",
        description="qfuse: post-training quantization of PyTorch models to fused int8/fp8 "
        "kernels. Run 'qfuse sweep --help' for the accuracy-vs-speed sweep.",
    )
    parser.add_argument("--version", action="version", version=f"qfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = _sweep_parser(sub)
    best = _best_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # ``qfuse`` alone: what it can do, not a usage error
        parser.print_help()
        return 0
    if argv[0] == "sweep":
        _sweep_arguments(sweep)
    elif argv[0] == "best":
        _sweep_arguments(best, configs="fp32,best")
    args = parser.parse_args(argv)
    try:
        return _sweep(args)
    except QFuseError as exc:
        print(f"qfuse {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _sweep(args) -> int:
    from qfuse.tools.recipes import load_spec
    from qfuse.tools.sweep import run_sweep

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    spec = load_spec(args.recipe, reduced=args.reduced)
    max_drop = spec.default_max_drop if args.max_drop is None else args.max_drop
    suffix = "_best" if args.command == "best" else ""
    out = args.out or os.path.join("reports", spec.name + suffix)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    results = run_sweep(
        spec,
        configs,
        out,
        device=args.device,
        max_drop=max_drop,
        modes=modes,
        repeats=args.repeats,
        quiet=args.quiet,
        confidence=args.confidence,
    )
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        print(f.read())
    failed = [r["config"] for r in results["rows"] if "error" in r]
    if args.command == "best":
        _print_best(results)
    print(f"report: {os.path.join(out, 'report.md')}")
    if failed:
        print(f"qfuse sweep: {len(failed)} of {len(results['rows'])} configs failed: "
              f"{', '.join(failed)} (see their rows in the report)", file=sys.stderr)
        return 1
    return 0


def _print_best(results: dict) -> None:
    """``qfuse best``'s answer: the config, its held-out metric beside fp32's, and why."""
    search = results.get("search")
    row = next((r for r in results["rows"] if r["config"] == "best"), None)
    if search is None or row is None or "error" in row:
        print("qfuse best: no configuration met the budget (the report's search path says what "
              "each candidate measured).")
        return
    c = search["candidate"]
    print(f"best: {c['label']}")
    if "metric" in row:
        held = f"{results['metric']}: {row['metric']:.6g}"
        if "delta" in row:
            held += f" (change vs fp32 {row['delta']:+.4g})"
        print(held)
    margin = search.get("margin", 0.0)
    print(f"validation: {search['metric']:.6g} vs float {search['baseline']:.6g}, drop "
          f"{search['drop']:.4g} + margin {margin:.4g} <= max-drop {search['max_drop']:.4g} "
          f"({search.get('margin_rule', '')})")
    print(f"why: {search['why']}")
    print("reproduce: qfuse.prepare(model, QConfig.from_dict(config), ...) with "
          f"{json.dumps({k: v for k, v in c.items() if k != 'label'})}")
