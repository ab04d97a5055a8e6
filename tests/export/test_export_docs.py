"""The examples in docs/export.md and in the export modules' docstrings run as written."""

import doctest
import os

import pytest

import qfuse.export.program
import qfuse.export.safetensors
import qfuse.export.torchscript
from tests.export.cases import REPO_ROOT

FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")


def test_docs_export_md_examples(tmp_path):
    path = os.path.join(REPO_ROOT, "docs", "export.md")
    result = doctest.testfile(path, module_relative=False, optionflags=FLAGS)
    assert result.attempted > 10 and result.failed == 0


@pytest.mark.parametrize(
    "module", [qfuse.export.safetensors, qfuse.export.torchscript, qfuse.export.program]
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=FLAGS)
    assert result.attempted > 0 and result.failed == 0
