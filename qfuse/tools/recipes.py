"""Sweep specs: what a recipe hands the sweep, and where recipes are found.

A recipe is a module with a function ``sweep_spec(reduced: bool = False) -> SweepSpec``. The
project's recipes are registered here by module name (imported only when asked for); others
register with ``register_recipe`` or an entry point in the ``qfuse.recipes`` group, and a user
points ``qfuse sweep --recipe path/to/module.py`` at a file of their own.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import torch

from qfuse.errors import QFuseError


class RecipeError(QFuseError):
    """A recipe cannot be found or does not provide a usable sweep spec."""


@dataclass
class SweepSpec:
    """A model, its data and its metric, as the sweep and ``qfuse.search`` need them.

    Batches (``calibration``, ``example``) are what the model is called with: a tensor, a tuple
    of positional args or a dict of keyword args, on CPU. ``evaluate(model) -> float`` is the
    reported metric (held-out data); the sweep passes a model that accepts CPU batches and returns
    CPU float outputs, whatever device and dtype it runs in. ``validate`` is what ``best`` tunes
    on (data the report's metric never sees); it defaults to ``evaluate``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4)).eval()
        >>> xs = [torch.randn(8, 4) for _ in range(2)]
        >>> spec = SweepSpec("tiny", model, xs, lambda m: 1.0, xs[0], metric="one")
        >>> spec.validate is spec.evaluate
        True
    """

    name: str
    model: torch.nn.Module
    calibration: list
    evaluate: Callable[[torch.nn.Module], float]
    example: object
    metric: str = "metric"
    higher_is_better: bool = True
    validate: Callable[[torch.nn.Module], float] | None = None
    prepare_kwargs: dict = field(default_factory=dict)  # e.g. dynamic_shapes for qfuse.prepare
    default_max_drop: float = 0.01  # what `best` may lose when --max-drop is not given
    description: str = ""
    search_space: object | None = None  # the SearchSpace `best` searches (None: SearchSpace())

    def __post_init__(self) -> None:
        if self.validate is None:
            self.validate = self.evaluate
        if not self.calibration:
            raise RecipeError(f"recipe {self.name!r}: calibration has no batches.")


# name -> module that defines sweep_spec (or a callable returning a SweepSpec)
_REGISTRY: dict[str, str | Callable[..., SweepSpec]] = {
    "digits": "qfuse.recipes.ptq_digits",
    "llm": "qfuse.recipes.ptq_llm",
    "minilm": "qfuse.recipes.ptq_minilm",
    "mlp": "qfuse.recipes.ptq_mlp",
    "resnet": "qfuse.recipes.ptq_resnet",
}
DEFAULT_RECIPE = "digits"


def register_recipe(name: str, target: str | Callable[..., SweepSpec]) -> None:
    """Make ``--recipe name`` resolve to a module name (with ``sweep_spec``) or a callable.

    Example:
        >>> register_recipe("doc_example", "qfuse.recipes.ptq_digits")
        >>> "doc_example" in recipe_names()
        True
    """
    if not name or os.sep in name or name.endswith(".py"):
        raise RecipeError(f"recipe name {name!r}: use a plain name (files are passed by path).")
    _REGISTRY[name] = target


def recipe_names() -> list[str]:
    """Registered names and ``qfuse.recipes`` entry points."""
    names = set(_REGISTRY) | {ep.name for ep in entry_points(group="qfuse.recipes")}
    return sorted(names)


def _module_from_file(path: str):
    if not os.path.isfile(path):
        raise RecipeError(f"recipe file {path!r} does not exist.")
    name = "qfuse_user_recipe_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return module


def _import(recipe: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):  # the recipe itself is missing
            raise RecipeError(
                f"recipe {recipe!r} is registered as module {module_name!r}, which is not "
                f"installed in this checkout. Available: {', '.join(recipe_names())}; or pass "
                "a file: --recipe path/to/module.py."
            ) from exc
        raise RecipeError(
            f"recipe {recipe!r} ({module_name}) needs {exc.name!r}, which is not installed "
            '(pip install -e ".[recipes]").'
        ) from exc


def _resolve(recipe: str):
    if recipe.endswith(".py") or os.sep in recipe:
        return _module_from_file(recipe)
    target = _REGISTRY.get(recipe)
    if target is None:
        eps = [ep for ep in entry_points(group="qfuse.recipes") if ep.name == recipe]
        if not eps:
            raise RecipeError(
                f"unknown recipe {recipe!r}: choose one of {', '.join(recipe_names())}, or "
                "pass a file: --recipe path/to/module.py (it defines sweep_spec())."
            )
        target = eps[0].load()
    return _import(recipe, target) if isinstance(target, str) else target


def load_spec(recipe: str = DEFAULT_RECIPE, reduced: bool = False) -> SweepSpec:
    """The ``SweepSpec`` of a registered recipe name, a module name or a ``.py`` file.

    ``reduced`` asks the recipe for a small setting (CI, smoke tests).

    Example:
        >>> spec = load_spec("digits", reduced=True)
        >>> spec.name, spec.metric
        ('digits', 'top-1 %')
    """
    target = _resolve(recipe)
    fn = target if callable(target) and not inspect.ismodule(target) else None
    if fn is None:
        fn = getattr(target, "sweep_spec", None)
        if not callable(fn):
            raise RecipeError(
                f"recipe {recipe!r} ({getattr(target, '__file__', target)}) has no function "
                "sweep_spec(reduced=False) returning a qfuse.tools.SweepSpec; add one."
            )
    accepts_reduced = "reduced" in inspect.signature(fn).parameters
    spec = fn(reduced=reduced) if accepts_reduced else fn()
    if not isinstance(spec, SweepSpec):
        raise RecipeError(
            f"recipe {recipe!r}: sweep_spec() returned {type(spec).__name__}, not a SweepSpec."
        )
    return spec
