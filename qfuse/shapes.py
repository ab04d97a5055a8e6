"""Input shapes a captured graph serves, and a ``ShapeError`` (not a bare ``AssertionError``)
when a call breaks them.

``torch.export`` puts its input checks in a ``_guards_fn`` submodule that the graph calls first;
a failing check raises ``AssertionError: Guard failed: x.size()[1] == 16``. ``guard_inputs``
wraps that submodule so the user reads which input, the shape it got and the shapes served.
"""

from __future__ import annotations

import ast
import copy
import dis
import inspect
import math
import re

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.errors import QFuseError, ShapeError

GUARDS = "_guards_fn"


def served_shapes(gm: fx.GraphModule) -> dict[str, str]:
    """Input name -> the shape the graph serves, ``*`` for a dynamic dimension.

    Example:
        >>> import torch, qfuse
        >>> from qfuse.pipeline.capture import capture
        >>> gm = capture(torch.nn.Linear(16, 4), (torch.randn(2, 5, 16),))
        >>> served_shapes(gm)
        {'input': '(*, *, 16)'}
    """
    shapes = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            dims = [_dim(d) for d in val.shape]
            shapes[node.target] = "(" + ", ".join(dims) + (",)" if len(dims) == 1 else ")")
    return shapes


def _dim(d) -> str:
    """A dimension export pinned is a SymInt whose expression is a number."""
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return str(int(expr)) if getattr(expr, "is_number", False) else "*"
    return str(int(d))


class ShapeGuard(nn.Module):
    """Runs export's input guards; a failed guard becomes a ``ShapeError`` naming the input.

    Export's guard function is generated source run through ``exec`` (and wrapped for Dynamo),
    which ``pickle`` cannot name: ``torch.save(qmodel)`` failed with "Can't pickle local object
    'wrap_dunder_call_ctx_manager.<locals>.inner'". ``checks`` holds the same guards as source
    (``guard_source``), so a pickled or deep-copied model compiles them again; where they could
    not be read back (``checks`` is None), pickling raises a ``QFuseError`` naming ``qfuse.save``.
    """

    _is_impure = True  # as export's module: no dead-code pass may drop the call (no users)

    def __init__(self, run, names: list[str], served: dict[str, str],
                 checks: list[tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.run = run  # export's guard function, or the same compiled from ``checks``
        self.names = names
        self.served = served
        self.checks = checks

    def forward(self, *args):
        try:
            return self.run(*args)
        except (AssertionError, IndexError) as exc:  # IndexError: an input of lower rank
            raise ShapeError(self.describe(args, str(exc))) from exc

    def __getstate__(self):
        if self.checks is None:
            raise QFuseError(
                "this model's input shape guards (torch.export's) cannot be pickled; save it "
                "with qfuse.save(qmodel, path) and rebuild it with qfuse.load."
            )
        state = dict(self.__dict__)
        del state["run"]
        return state

    def __deepcopy__(self, memo):
        twin = ShapeGuard.__new__(ShapeGuard)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items()
                                            if k != "run"}, memo))
        twin.run = self.run  # a function: shared, as deepcopy shares every function
        return twin

    def __setstate__(self, state):
        super().__setstate__(state)
        import torch._dynamo  # loaded by torch.export already; Dynamo traces the guards as export's

        self.run = torch._dynamo.dont_skip_tracing(compile_guards(self.checks))

    def describe(self, args, failed: str) -> str:
        check = failed.replace("Guard failed:", "").strip()
        got = {
            n: tuple(a.shape)
            for n, a in zip(self.names, args, strict=False)
            if isinstance(a, torch.Tensor)
        }
        head = None
        for name, shape in got.items():  # a pinned dimension of another size says it plainest
            served = self.served.get(name, "()").strip("(,)").split(", ")
            if len(served) != len(shape):
                head = f"input {name!r} has {len(shape)} dimensions {shape}, not {len(served)}"
                break
            bad = [
                d
                for d, (s, g) in enumerate(zip(served, shape, strict=True))
                if s != "*" and int(s) != g
            ]
            if bad:
                d = bad[0]
                head = (
                    f"input {name!r} has shape {shape}: dimension {d} is {shape[d]}, "
                    f"but this model was built for {served[d]} there"
                )
                break
        match = re.fullmatch(r"(\w+)\.size\(\)\[(\d+)\] *(==|<=|>=|<|>) *\d+", check)
        if head is None and match and match.group(1) in got:
            name, dim = match.group(1), int(match.group(2))
            head = f"input {name!r} has shape {got[name]}: dimension {dim} breaks `{check}`"
        elif head is None:
            head = f"the input shapes {got} break the check `{check}`"
        serves = "; ".join(f"{n} {s}" for n, s in self.served.items())
        return (
            f"{head}. This model serves {serves} (* = any size). A fixed dimension was pinned "
            "by the model or by the example inputs at qfuse.prepare: pass inputs of the served "
            "shapes, or prepare again with examples of the shapes you need (dynamic_shapes= "
            "to free a dimension)."
        )


def guard_inputs(gm: fx.GraphModule, example_inputs: tuple | None = None) -> bool:
    """Wrap ``gm``'s export guards in a ``ShapeGuard``; False if the graph has none.
    ``example_inputs``: the program's ``(args, kwargs)``, which name the guards' inputs (without
    them the guards run, but a pickled copy cannot rebuild them)."""
    guards = getattr(gm, GUARDS, None)
    if guards is None or isinstance(guards, ShapeGuard):
        return False
    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == GUARDS), None)
    if call is None:
        return False
    names = [a.target for a in call.args if isinstance(a, fx.Node)]
    checks = None
    if example_inputs is not None:
        checks = guard_source(guards.forward, _input_paths(gm, example_inputs))
    setattr(gm, GUARDS, ShapeGuard(guards.forward, names, served_shapes(gm), checks))
    return True


_FAILED = "Guard failed: "


def _input_paths(gm: fx.GraphModule, example_inputs: tuple) -> list[str]:
    """How export's guard messages write each flat input (``x``, ``inputs['ids']``), in the
    order of the guard function's ``args`` (torch.export._unlift's ``_get_input_paths``)."""
    args, kwargs = example_inputs
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    paths = [path for path, _ in pytree.tree_leaves_with_path(bound.arguments)]
    return [path[0].key + pytree.keystr(path[1:]) for path in paths]


def _guard_function(run):
    """The generated function under Dynamo's wrapper (a closure around it), or None."""
    todo, seen = [run], set()
    while todo:
        fn = todo.pop()
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if code.co_name == "_" and code.co_flags & inspect.CO_VARARGS:  # ``def _(*args)``
            return fn
        todo += [cell.cell_contents for cell in fn.__closure__ or ()
                 if callable(getattr(cell, "cell_contents", None))]
    return None


def guard_source(run, paths: list[str]) -> list[tuple[str, str]] | None:
    """Export's guards as ``(condition, message)`` source pairs, read back from its generated
    function ``run``: each message is ``"Guard failed: <condition over input names>"``, and
    naming the inputs ``args[i]`` again gives the condition. None unless the source compiles to
    the very bytecode export generated (the check that nothing was read back wrong)."""
    fn = _guard_function(run)
    if fn is None:
        return None
    where = {ast.unparse(ast.parse(p, mode="eval")): i for i, p in enumerate(paths)}

    class ToArgs(ast.NodeTransformer):
        def visit(self, node):
            index = where.get(ast.unparse(node)) if isinstance(node, ast.expr) else None
            if index is None:
                return self.generic_visit(node)
            return ast.parse(f"args[{index}]", mode="eval").body

    checks = []
    messages = [i.argval for i in dis.get_instructions(fn)
                if isinstance(i.argval, str) and i.argval.startswith(_FAILED)]
    for message in messages:  # in order, repeats included (export repeats some guards)
        try:
            tree = ToArgs().visit(ast.parse(message[len(_FAILED):], mode="eval"))
        except SyntaxError:
            return None
        checks.append((ast.unparse(tree), message))
    try:
        rebuilt = compile_guards(checks).__code__
    except SyntaxError:
        return None
    same = all(getattr(rebuilt, a) == getattr(fn.__code__, a)
               for a in ("co_code", "co_consts", "co_names"))
    return checks if same else None


def compile_guards(checks: list[tuple[str, str]]):
    """The guard function of ``checks`` (``guard_source``), compiled as export compiles it."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP  # sympy: only when needed

    lines = [f"  torch._assert({cond}, {message!r})" for cond, message in checks]
    namespace = {**SYMPY_INTERP, "math": math, "inf": float("inf")}
    exec("\ndef _(*args):\n" + "".join(line + "\n" for line in lines) + "  return\n", namespace)
    return namespace["_"]
