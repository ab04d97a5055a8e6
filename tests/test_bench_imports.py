"""Every module under ``bench/`` imports: a qfuse module or name a benchmark uses at import time
that was renamed or removed fails here, in CI on the CPU, not later on the device machine.

The benchmarks only run on a GPU, so nothing else in the suite imports most of them; one fresh
process imports them all (a benchmark may set up its process at import, e.g. the Triton
interpreter, and this test's process must not inherit that)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Imports each module named on the command line; prints one line per module that failed (a
# module's own prints at import are not failures).
_IMPORT_ALL = """
import importlib, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # SystemExit too: a module that exits at import is broken
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"FAILED {name}: {type(exc).__name__}: {exc} ({frame.filename}:{frame.lineno})")
"""


def bench_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def test_every_bench_module_imports():
    modules = bench_modules()
    # the walk found the package and its groups, not an empty or moved folder
    assert {"bench", "bench.harness", "bench.kernels.decode_gemm_ab",
            "bench.models.bench_llm", "bench.tune.tune_qgemm"} <= set(modules)
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    assert not failed, "bench modules that do not import:\n" + "\n".join(failed)
