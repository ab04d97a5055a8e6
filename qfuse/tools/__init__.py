"""Tools built on the public API: accuracy-vs-speed sweeps, the ``best`` config search, reports.

``qfuse.tools.search`` finds the fastest calibration setup that meets an accuracy budget;
``qfuse.tools.sweep`` measures a list of configs on a recipe and writes a report directory
(``qfuse sweep`` on the command line). Nothing below ``qfuse/tools`` imports from here.
"""

import importlib

# Name -> its module, imported on first access: the command line reads ``tools.recipes`` (no
# flows) to print its help; the search and the sweep load the flows and the ops (PEP 562).
_LAZY = {
    "RecipeError": "qfuse.tools.recipes",
    "SweepSpec": "qfuse.tools.recipes",
    "load_spec": "qfuse.tools.recipes",
    "register_recipe": "qfuse.tools.recipes",
    "Candidate": "qfuse.tools.search",
    "SearchResult": "qfuse.tools.search",
    "SearchSpace": "qfuse.tools.search",
    "search": "qfuse.tools.search",
    "CONFIGS": "qfuse.tools.sweep",
    "run_sweep": "qfuse.tools.sweep",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'qfuse.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "CONFIGS",
    "Candidate",
    "RecipeError",
    "SearchResult",
    "SearchSpace",
    "SweepSpec",
    "load_spec",
    "register_recipe",
    "run_sweep",
    "search",
]
