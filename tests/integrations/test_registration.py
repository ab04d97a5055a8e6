"""``import qfuse`` registers quant_method "qfuse" with transformers, whichever is imported
first, without importing transformers itself."""

import sys

import pytest

import qfuse  # noqa: F401
from qfuse.integrations import _AfterImport


def test_callback_runs_once_right_after_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "qfuse_probe_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = _AfterImport("qfuse_probe_module", lambda: seen.append(
        sys.modules["qfuse_probe_module"].VALUE))
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    import qfuse_probe_module  # noqa: F401

    assert seen == [42] and hook not in sys.meta_path  # after its body ran; then out of the way
    monkeypatch.delitem(sys.modules, "qfuse_probe_module")


def test_registered_with_transformers():
    pytest.importorskip("transformers")
    from transformers.quantizers import auto

    registered = auto.AUTO_QUANTIZER_MAPPING.get("qfuse")  # by the hook or by install()
    from qfuse.integrations.transformers import QFuseConfig, QFuseHfQuantizer

    assert registered is QFuseHfQuantizer
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["qfuse"] is QFuseConfig
