"""Root pytest setup (applies to tests/ and to the docstring examples under qfuse/).

TRITON_INTERPRET must be set before anything imports triton kernels, so that the Triton kernels
run on CPU tensors in the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
