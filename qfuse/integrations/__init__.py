"""qfuse inside other libraries' workflows: transformers' ``save_pretrained`` /
``from_pretrained`` (``qfuse.integrations.transformers``).

Importing transformers' quantizer registry costs seconds, so ``import qfuse`` does not: it
registers the qfuse quantizer now if transformers has loaded it, else the moment transformers
does (``from_pretrained`` cannot run before it has).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from qfuse.flows.hooks import AFTER_SWAP

_REGISTRY = "transformers.quantizers.auto"


def _register_transformers() -> None:
    try:  # registers itself on import (a plain import: it may be the one importing transformers)
        import qfuse.integrations.transformers  # noqa: F401
    except ImportError as exc:  # a transformers without the quantizer API qfuse uses
        warnings.warn(f"qfuse: not registered with transformers ({exc}); from_pretrained will "
                      "not rebuild qfuse models.", stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after module ``name`` is first imported."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find_spec below must not find us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_register(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_register
        return spec


def _attach(model) -> None:
    """A model ``output="model"`` returns: a transformers ``PreTrainedModel`` gets qfuse's
    quantizer (``save_pretrained``) and decode graphs. transformers has been imported if the
    model is one of its classes."""
    if "transformers.modeling_utils" in sys.modules:
        from qfuse.integrations.transformers import attach

        attach(model)


def install() -> None:
    """Register with transformers now or when it is imported, and with the model swap."""
    if _attach not in AFTER_SWAP:
        AFTER_SWAP.append(_attach)
    if _REGISTRY in sys.modules:
        _register_transformers()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_REGISTRY, _register_transformers))
