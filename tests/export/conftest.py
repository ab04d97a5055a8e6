"""The session-wide cache of converted models (see ``cases.py`` for the models)."""

import pytest

import qfuse
from tests.export.cases import Case, minilm_case, quantize, small_case


@pytest.fixture(scope="session")
def make_case():
    """``make_case(name, config)``: the converted ``Case``, built once per session."""
    cache: dict = {}

    def get(name: str, config: qfuse.QConfig) -> Case:
        key = (name, repr(config))
        if key not in cache:
            case = minilm_case() if name == "minilm" else small_case(name)
            case.qmodel, case.config = quantize(case, config), config
            cache[key] = case
        return cache[key]

    return get
