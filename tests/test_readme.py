"""The README's example is real code: run it."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.startswith("pip install")]
    want = 'pip install --no-compile -e ".[recipes,test]" && python -m pytest -q -n 2'
    assert commands == [want], commands
    assert f"```bash\n{commands[0]}\n```" in README.read_text()
