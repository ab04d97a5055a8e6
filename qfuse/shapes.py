"""Input shapes a captured graph serves, and a ``ShapeError`` (not a bare ``AssertionError``)
when a call breaks them.

``torch.export`` puts its input checks in a ``_guards_fn`` submodule that the graph calls first;
a failing check raises ``AssertionError: Guard failed: x.size()[1] == 16``. ``guard_inputs``
wraps that submodule so the user reads which input, the shape it got and the shapes served.
"""

from __future__ import annotations

import re

import torch
from torch import fx, nn

from qfuse.errors import ShapeError

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
    """Runs export's input guards; a failed guard becomes a ``ShapeError`` naming the input."""

    def __init__(self, guards: nn.Module, names: list[str], served: dict[str, str]) -> None:
        super().__init__()
        self.guards = guards
        self.names = names
        self.served = served

    def forward(self, *args):
        try:
            return self.guards(*args)
        except (AssertionError, IndexError) as exc:  # IndexError: an input of lower rank
            raise ShapeError(self.describe(args, str(exc))) from exc

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


def guard_inputs(gm: fx.GraphModule) -> bool:
    """Wrap ``gm``'s export guards in a ``ShapeGuard``; False if the graph has none."""
    guards = getattr(gm, GUARDS, None)
    if guards is None or isinstance(guards, ShapeGuard):
        return False
    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == GUARDS), None)
    if call is None:
        return False
    names = [a.target for a in call.args if isinstance(a, fx.Node)]
    setattr(gm, GUARDS, ShapeGuard(guards, names, served_shapes(gm)))
    return True
