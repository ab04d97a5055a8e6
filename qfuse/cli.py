"""``qfuse`` on the command line: ``qfuse sweep --recipe digits --configs ... --out reports/X``
(also ``python -m qfuse``)."""

from __future__ import annotations

import argparse
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


def _sweep_arguments(p) -> None:
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
        default=",".join(CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument("--out", default=None, help="report directory (default reports/RECIPE)")
    p.add_argument(
        "--max-drop",
        type=float,
        default=None,
        help="largest metric drop vs fp32 that 'best' may accept, in the recipe's metric units "
        "(default: the recipe's default_max_drop)",
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
        usage: qfuse [-h] [--version] {sweep} ...
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # ``qfuse`` alone: what it can do, not a usage error
        parser.print_help()
        return 0
    if argv[0] == "sweep":
        _sweep_arguments(sweep)
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
    out = args.out or os.path.join("reports", spec.name)
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
    )
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        print(f.read())
    failed = [r["config"] for r in results["rows"] if "error" in r]
    print(f"report: {os.path.join(out, 'report.md')}")
    if failed:
        print(f"qfuse sweep: {len(failed)} of {len(results['rows'])} configs failed: "
              f"{', '.join(failed)} (see their rows in the report)", file=sys.stderr)
        return 1
    return 0
