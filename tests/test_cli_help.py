"""Every command's ``--help`` renders: argparse formats help strings with ``%``, so a bare
``%`` in one (``"% of float's"``) makes ``--help`` itself crash with a TypeError."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# argparse's own fields (%(default)s, %(prog)s ...) and an escaped %%
_OK = re.compile(r"%%|%\([a-z_]+\)[a-z]")


def _help_strings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        if func not in ("add_argument", "ArgumentParser", "add_parser",
                        "add_argument_group"):
            continue
        for kw in node.keywords:
            if kw.arg not in ("help", "description", "epilog", "usage"):
                continue
            parts = [kw.value] if isinstance(kw.value, ast.Constant) else [
                v for v in ast.walk(kw.value) if isinstance(v, ast.Constant)]
            for v in parts:
                if isinstance(v.value, str):
                    yield kw.value.lineno, v.value


def test_no_bare_percent_in_argparse_help():
    bad = []
    for sub in ("qfuse", "recipes", "bench", "calibration"):
        for path in (ROOT / sub).rglob("*.py"):
            src = path.read_text()
            if "argparse" not in src and "add_argument" not in src:
                continue
            for line, text in _help_strings(path):
                if "%" in _OK.sub("", text):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not bad, "a bare % breaks --help (write %%):\n" + "\n".join(bad)


def test_the_check_sees_the_bug(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('import argparse\nargparse.ArgumentParser().add_argument("--x", help="a % b")\n')
    assert [t for _, t in _help_strings(p) if "%" in _OK.sub("", t)] == ["a % b"]
