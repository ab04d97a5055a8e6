"""Tools built on the public API: accuracy-vs-speed sweeps, the ``best`` config search, reports.

``qfuse.tools.search`` finds the fastest calibration setup that meets an accuracy budget;
``qfuse.tools.sweep`` measures a list of configs on a recipe and writes a report directory
(``qfuse sweep`` on the command line). Nothing below ``qfuse/tools`` imports from here.
"""

from qfuse.tools.recipes import RecipeError, SweepSpec, load_spec, register_recipe
from qfuse.tools.search import Candidate, SearchResult, SearchSpace, search
from qfuse.tools.sweep import CONFIGS, run_sweep

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
