"""Converted graphs that ``pickle``, ``torch.save`` and ``copy.deepcopy`` as whole modules.

``fx.GraphModule`` pickles its generated Python and traces it again on load, with the tracer the
graph was made by. A graph of ``torch.export`` names ``_ModuleStackTracer``, which cannot be
built without arguments ("missing 1 required positional argument: 'scope_root'"), and a trace of
the code would not give the graph back anyway: qfuse's guard functions (``check_input``) would
run on proxies instead of being recorded, and the pytree wrapping of inputs and outputs (a
transformers ``ModelOutput``) would be lost. A converted graph therefore pickles its nodes as
they are (``PicklableGraphModule``): operator overloads by their qualified names, the other
targets by reference, each node's module path and stack trace (not its fake-tensor values,
which belong to the capture; ``torch.export`` records them again when the model is exported).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import fx
from torch.utils import _pytree as pytree

from qfuse.errors import QFuseError

_KEPT_META = ("nn_module_stack", "stack_trace")  # the rest holds fake tensors and their graph


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node argument that is another node (by name)."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Op:
    """A ``torch.ops`` overload by its qualified name (``aten::linear``, ``default``)."""

    name: str
    overload: str | None

    def resolve(self):
        namespace, name = self.name.split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        return packet if self.overload is None else getattr(packet, self.overload)


def _target(target):
    if isinstance(target, torch._ops.OpOverload):
        return _Op(target._schema.name, target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _Op(target._qualified_op_name, None)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _Op(f"higher_order::{target.name()}", None)
    if "<locals>" in getattr(target, "__qualname__", ""):
        raise QFuseError(
            f"this graph calls the local function {target.__qualname__}, which pickle cannot "
            "name; save the model with qfuse.save(qmodel, path) and rebuild it with qfuse.load."
        )
    return target


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A pytree ``TreeSpec`` as nested ``(type, context, children)``: unpickling a spec itself
    builds a ``LeafSpec``, which torch 2.13 deprecates with a FutureWarning on every load."""

    tree: tuple | None

    @classmethod
    def of(cls, spec):
        def tree(s):
            return None if s.is_leaf() else (s.type, s._context, [tree(c) for c in s.children()])

        return cls(tree(spec)) if isinstance(spec, pytree.TreeSpec) else spec

    def resolve(self):
        leaf = getattr(pytree, "treespec_leaf", None) or pytree.LeafSpec  # torch < 2.13

        def spec(t):
            return leaf() if t is None else pytree.TreeSpec(t[0], t[1], [spec(c) for c in t[2]])

        return spec(self.tree)


def _codegen(graph: fx.Graph):
    codegen = graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        info = codegen.pytree_info
        return ("pytree", info.orig_args, _Spec.of(info.in_spec), _Spec.of(info.out_spec))
    return codegen


def _resolve_codegen(codegen):
    if not isinstance(codegen, tuple):
        return codegen
    _, orig_args, in_spec, out_spec = codegen
    specs = [s.resolve() if isinstance(s, _Spec) else s for s in (in_spec, out_spec)]
    return fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(orig_args, *specs))


def _encode(graph: fx.Graph) -> dict:
    nodes = []
    for node in graph.nodes:
        meta = {k: node.meta[k] for k in _KEPT_META if k in node.meta}
        args = fx.node.map_arg(node.args, lambda n: _Ref(n.name))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: _Ref(n.name))
        nodes.append((node.op, node.name, _target(node.target), args, kwargs, meta))
    return {"codegen": _codegen(graph), "nodes": nodes}


def _decode(encoded: dict) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = _resolve_codegen(encoded["codegen"])
    env: dict[str, fx.Node] = {}

    def node_of(value):
        if isinstance(value, _Ref):
            return env[value.name]
        if isinstance(value, slice):
            return slice(node_of(value.start), node_of(value.stop), node_of(value.step))
        if isinstance(value, (tuple, list)):
            return type(value)(node_of(v) for v in value)
        if isinstance(value, dict):
            return type(value)({k: node_of(v) for k, v in value.items()})
        return value

    for op, name, target, args, kwargs, meta in encoded["nodes"]:
        target = target.resolve() if isinstance(target, _Op) else target
        node = graph.create_node(op, target, node_of(args), node_of(kwargs), name=name)
        node.meta.update(meta)
        env[name] = node
    return graph


def _rebuild(cls: type, body: dict, encoded: dict) -> fx.GraphModule:
    """The unpickled module: ``GraphModule.__deepcopy__``'s construction on a decoded graph."""
    graph = _decode(encoded)
    body = {k: v.resolve() if isinstance(v, _Spec) else v for k, v in body.items()}
    holder = fx.graph_module._CodeOnlyModule(body)
    gm = cls.__new__(cls)
    fx.GraphModule.__init__(gm, holder, graph)
    for key, value in body.items():  # what __init__ does not carry: meta, hooks, attributes
        hooks = key.endswith(("hooks", "_with_kwargs", "_always_called"))
        if key not in ("_graph", "_code") and (hooks or key not in gm.__dict__):
            gm.__dict__[key] = value
    gm.meta = body.get("meta", {})
    return gm


class PicklableGraphModule(fx.GraphModule):
    """An ``fx.GraphModule`` that pickles its graph node by node (see the module docstring)."""

    def __reduce__(self):
        body = {k: _Spec.of(v) for k, v in self.__dict__.items()
                if k not in ("_graph", "train", "eval")}
        return (_rebuild, (PicklableGraphModule, body, _encode(self.graph)))

    def __deepcopy__(self, memo):
        with warnings.catch_warnings():  # the same LeafSpec deprecation, from copying the specs
            warnings.filterwarnings("ignore", "`isinstance.treespec, LeafSpec", FutureWarning)
            return super().__deepcopy__(memo)


def make_picklable(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm`` (in place) a ``PicklableGraphModule``; returns it.

    Example:
        >>> import io, pickle, torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> x = torch.randn(2, 4)
        >>> gm = make_picklable(torch.fx.symbolic_trace(m))
        >>> torch.equal(pickle.loads(pickle.dumps(gm))(x), gm(x))
        True
    """
    if not isinstance(gm, PicklableGraphModule):
        # GraphModule gives every instance a class of its own (its generated forward lives
        # there); this one's derives from PicklableGraphModule instead of export's class.
        gm.__class__ = type("GraphModuleImpl", (PicklableGraphModule,), {})
        gm.recompile()
    return gm
