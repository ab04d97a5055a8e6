"""transformers' compiled decode step as CUDA graphs that qfuse captures and replays itself.

``generate()`` with a compileable cache (``cache_implementation="static"``) runs every decode step
through ``model.get_compiled_call()``: ``torch.compile(model.__call__, mode="reduce-overhead")``.
Each call of that compiled function first runs Dynamo's guards over every parameter, AOTAutograd's
runtime wrapper and CUDA-graph trees' input checks in Python; at batch 1 the step is host-bound,
and the host work grows with the graph's inputs. A quantized layer brings its scales beside its
weight, so a converted model pays more host time per token for a shorter GPU step, and its
kernels' gain does not reach ``generate()`` (profiles of the decode step show the host work).

``DecodeGraphs`` stands in for that compiled call (``install``; transformers finds it where it
caches its own, ``model._compiled_call``). It compiles the same forward with the same options
minus Inductor's CUDA graphs, plus Inductor's programmatic dependent launch (``_with_pdl``;
``QFUSE_PDL=0``: off), and keeps up to ``MAX_GRAPHS`` CUDA graphs of it, one per input
signature. A signature's first call runs the compiled forward on the graph's own input buffers
(Dynamo compiles, kernels initialize); its second call captures the graph and replays it; later
calls copy their input tensors into the buffers, check that the model's and the cache's tensors
are the ones captured, and replay. A call never runs twice: the cache's step counter and keys are
written once per call, by the warm run or by the replay (capturing executes nothing).

What a captured graph assumes, checked before every replay:
- the module tree is the one captured: the same submodules, and the same parameter, buffer and
  tensor-attribute objects at the same addresses (``load_state_dict`` copies in place and keeps
  the graph; ``to()``, swapping a module or assigning new tensors make the next call capture
  again);
- the cache is the object captured and its tensors are the captured ones, unmoved (a graph
  holds them weakly: a dropped cache's memory is freed, and its graph goes with the next
  capture);
- every other input tensor has the captured shape, strides, dtype and device (its values are
  copied in) and every other input is equal.
Not checked: a module's plain Python settings (a layer's activation name); call ``reset()``
after changing one. Anything the graphs cannot take (CPU tensors, autograd, autocast, a capture
or compile already running, an input that cannot be keyed, a failed capture) runs the compiled
call transformers itself would have built.

``QFUSE_DECODE_GRAPHS=0`` leaves transformers' compiled call in place (``install`` does nothing).
"""

from __future__ import annotations

import collections
import copy
import operator
import os
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

MAX_GRAPHS = 4
_KEYABLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def enabled() -> bool:
    """False when ``QFUSE_DECODE_GRAPHS=0``."""
    return os.environ.get("QFUSE_DECODE_GRAPHS", "1") != "0"


def install(model) -> DecodeGraphs | None:
    """Run ``model.generate()``'s compiled decode steps through a ``DecodeGraphs`` of ``model``
    (a transformers ``PreTrainedModel``, quantized or not). Returns it, or None where
    ``QFUSE_DECODE_GRAPHS=0`` or the model has no ``get_compiled_call``."""
    if not enabled() or not callable(getattr(model, "get_compiled_call", None)):
        return None
    runner = DecodeGraphs(model)
    # get_compiled_call returns model._compiled_call while the generation's CompileConfig is the
    # model's default one; another CompileConfig makes transformers compile its own (the
    # user's explicit choice wins).
    model._compiled_call = runner
    return runner


def _is_cache(x) -> bool:
    # the class attribute: an instance's is_compileable is a property that walks the layers
    return (getattr(type(x), "is_compileable", None) is not None
            and not isinstance(x, torch.Tensor))


def _flatten(args: tuple, kwargs: dict) -> tuple[list, object]:
    """(leaves, spec). A decode step's keyword arguments are leaves already: keyed by their
    names (hashing a pytree spec every call costs more than the rest of the key)."""
    if not args and not any(isinstance(v, (dict, list, tuple)) for v in kwargs.values()):
        return list(kwargs.values()), tuple(kwargs)
    return pytree.tree_flatten((args, kwargs), is_leaf=_is_cache)


def _unflatten(leaves: list, spec) -> tuple[tuple, dict]:
    if isinstance(spec, tuple):
        return (), dict(zip(spec, leaves, strict=True))
    return pytree.tree_unflatten(leaves, spec)


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return ("t", tuple(x.shape), x.stride(), x.dtype, x.device)
    if _is_cache(x):
        return ("c", id(x))
    if isinstance(x, _KEYABLE):
        return (type(x), x)
    raise TypeError


def _object_slots(obj, seen: set, depth: int = 3) -> list:
    """``(owner, name, tensor)`` for every tensor in ``obj.__dict__``, through lists, tuples and
    plain objects ``depth`` deep: a cache's layers and their key/value tensors."""
    slots = []
    d = getattr(obj, "__dict__", None)
    if d is None or id(obj) in seen or isinstance(obj, (type, torch.nn.Module)):
        return slots
    seen.add(id(obj))
    for name, v in d.items():
        if isinstance(v, torch.Tensor):
            slots.append((obj, name, v))
        elif depth and isinstance(v, (list, tuple)):
            for item in v:
                slots += _object_slots(item, seen, depth - 1)
        elif depth and hasattr(v, "__dict__"):
            slots += _object_slots(v, seen, depth - 1)
    return slots


def _with_pdl(opts: dict) -> dict:
    """``opts`` with Inductor's programmatic dependent launch on (``grid.pdl``'s switch): each
    generated kernel may start while the one before it drains and waits before reading what
    that one wrote. A decode step is ~500 short kernels replayed from one graph, so the gaps
    between them are a large part of its GPU time; qfuse's own GEMMs launch the same way. A
    mode is spelled out as its options, since ``torch.compile`` takes one or the other."""
    import torch._inductor
    import torch._inductor.config

    from qfuse.kernels import grid

    triton_config = getattr(torch._inductor.config, "triton", None)
    if not grid.PDL_ENABLED or not hasattr(triton_config, "enable_pdl"):
        return opts
    opts = dict(opts)
    options = dict(opts.get("options") or {})
    if opts.get("mode"):
        options = {**torch._inductor.list_mode_options(opts["mode"]), **options}
        opts["mode"] = None
    options["triton.enable_pdl"] = True
    opts["options"] = options
    return opts


def _module_slots(model: torch.nn.Module) -> list:
    """``(dict, name, object)`` for every submodule, parameter, buffer and tensor attribute."""
    slots = []
    for m in model.modules():
        for d in (m._modules, m._parameters, m._buffers):
            slots += [(d, name, v) for name, v in d.items() if v is not None]
        slots += [(m.__dict__, name, v) for name, v in m.__dict__.items()
                  if isinstance(v, torch.Tensor)]
    return slots


_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # CUDA builds


def _ptrs_equal(tensors: list, ptrs: list, indices: list) -> bool:
    if _PTRS_EQUAL is not None:
        return _PTRS_EQUAL(tensors, ptrs, indices)
    return [t.data_ptr() for t in tensors] == ptrs


class _Entry:
    """One input signature: its static input buffers, then (after the capture) its graph, the
    output the graph writes, and what the graph assumes about the model and the cache."""

    def __init__(self, leaves: list) -> None:
        self.tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.static = [_static_copy(leaves[i]) for i in self.tensor_idx]
        self.graph = None
        self.off = False
        self.caches: list = []  # weak references: a graph must not keep a dropped cache alive
        self.out_flat: list = []
        self.out_spec = None
        self.out_kind: list = []  # per output leaf: "clone", "as is", or an input cache's index
        self.dicts: tuple = ()
        self.names: tuple = ()
        self.objs: tuple = ()
        # the caches' tensors, weakly: a graph must not keep a dropped cache's memory alive
        self.cache_slots: list = []
        self.tensors: list = []
        self.ptrs: list = []
        self.indices: list = []

    def leaves(self, leaves: list) -> list:
        """The call's leaves with its tensors replaced by the static buffers."""
        merged = list(leaves)
        for i, t in zip(self.tensor_idx, self.static, strict=True):
            merged[i] = t
        return merged

    def copy_in(self, leaves: list) -> None:
        if self.static:
            torch._foreach_copy_(self.static, [leaves[i] for i in self.tensor_idx])

    def record(self, model, caches: list) -> list:
        """What the graph bakes in: the module tree's objects (held: the model holds them
        anyway) and the caches' tensors (weakly). Returns the caches' tensors."""
        slots = _module_slots(model)
        self.dicts, self.names, self.objs = (
            (tuple(z) for z in zip(*slots, strict=True)) if slots else ((),) * 3)
        self.tensors = [v for v in self.objs if isinstance(v, torch.Tensor)]
        seen: set = set()
        cache_slots = [slot for c in caches for slot in _object_slots(c, seen)]
        self.cache_slots = [(weakref.ref(o), name, weakref.ref(t)) for o, name, t in cache_slots]
        cache_tensors = [t for _, _, t in cache_slots]
        self.ptrs = [t.data_ptr() for t in self.tensors + cache_tensors]
        self.indices = list(range(len(self.ptrs)))
        self.caches = [weakref.ref(c) for c in caches]
        return cache_tensors

    def dead(self) -> bool:
        return any(r() is None for r in self.caches)

    def valid(self, caches: list) -> bool:
        if not (len(caches) == len(self.caches)
                and all(r() is c for r, c in zip(self.caches, caches, strict=True))
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.objs))):
            return False
        current = []
        for owner, name, ref in self.cache_slots:
            o = owner()
            t = None if o is None else o.__dict__.get(name)
            if t is None or t is not ref():
                return False
            current.append(t)
        return _ptrs_equal(self.tensors + current, self.ptrs, self.indices)

    def result(self, caches: list):
        """The graph's output for this call: its own tensors copied (the next replay overwrites
        them), the model's and the cache's tensors as they are, the call's cache objects."""
        flat = [x.clone() if k == "clone" else x if k == "as is" else caches[k]
                for x, k in zip(self.out_flat, self.out_kind, strict=True)]
        if isinstance(self.out_spec, tuple):  # a flat ModelOutput: rebuilt without __init__
            cls, names, attrs = self.out_spec
            out = cls.__new__(cls)
            values = dict(zip(names, flat, strict=True))
            collections.OrderedDict.__init__(out)
            for k, v in values.items():
                collections.OrderedDict.__setitem__(out, k, v)
            out.__dict__.update(attrs)
            out.__dict__.update(values)
            return out
        return pytree.tree_unflatten(flat, self.out_spec)


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class DecodeGraphs:
    """``model.__call__`` compiled once and replayed as CUDA graphs, one per input signature:
    see the module docstring. ``stats`` counts captures, replays and fallback calls."""

    device_type = "cuda"

    def __init__(self, model, compile_options: dict | None = None) -> None:
        self._model = weakref.ref(model)
        self._options = compile_options
        self._compiled = None
        self._fallback = None
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._warned = False
        self.stats = collections.Counter()

    # -- the compiled forward -------------------------------------------------------------
    def _config(self) -> dict:
        if self._options is not None:
            return dict(self._options)
        model = self._model()
        config = getattr(getattr(model, "generation_config", None), "compile_config", None)
        config = config or model._default_compile_config()
        return config.to_dict()

    def _graphed_options(self) -> dict | None:
        """The compile options without Inductor's CUDA graphs, or None when the configured
        compile does not graph (then the graphs here would change what the user asked for)."""
        opts = self._config()
        mode, options = opts.get("mode"), dict(opts.get("options") or {})
        if opts.get("backend", "inductor") != "inductor":
            return None
        if mode in ("reduce-overhead", "max-autotune"):
            opts["mode"] = None if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
        elif options.pop("triton.cudagraphs", False):
            opts["options"] = options or None
        else:
            return None
        return _with_pdl(opts)

    def _compiled_fn(self):
        if self._compiled is None:
            opts = self._graphed_options()
            self._compiled = False if opts is None else torch.compile(self._model().__call__,
                                                                       **opts)
        return self._compiled

    def _fallback_fn(self):
        if self._fallback is None:
            self._fallback = torch.compile(self._model().__call__, **self._config())
        return self._fallback

    def reset(self) -> None:
        """Drop every captured graph (the next calls warm up and capture again)."""
        self._entries.clear()

    # -- a call -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        compiled = self._compiled_fn()
        leaves, spec = _flatten(args, kwargs)
        key = self._key(leaves, spec) if compiled else None
        if key is None:
            return self._fall_back(args, kwargs)
        caches = [x for x in leaves if _is_cache(x)]
        entry = self._entries.get(key)
        if entry is not None and entry.graph is not None and not entry.valid(caches):
            del self._entries[key]  # the model or the cache changed under the graph
            entry = None
        if entry is None:
            for k in [k for k, e in self._entries.items() if e.dead()]:
                del self._entries[k]  # graphs of caches that are gone
            entry = self._entries[key] = _Entry(leaves)
            while len(self._entries) > MAX_GRAPHS:
                self._entries.popitem(last=False)
            self.stats["warm"] += 1
            a, kw = _unflatten(entry.leaves(leaves), spec)
            return compiled(*a, **kw)
        self._entries.move_to_end(key)
        if entry.off:
            return self._fall_back(args, kwargs)
        entry.copy_in(leaves)
        if entry.graph is None:
            try:
                self._capture(entry, compiled, _unflatten(entry.leaves(leaves), spec), caches)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run uncaptured
                entry.off, entry.graph = True, None
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"qfuse DecodeGraphs: capture failed ({type(exc).__name__}: "
                                  f"{exc}); this input signature runs torch.compile's call.",
                                  stacklevel=2)
                return self._fall_back(args, kwargs)
        entry.graph.replay()
        self.stats["replay"] += 1
        return entry.result(caches)

    def _fall_back(self, args: tuple, kwargs: dict):
        self.stats["fallback"] += 1
        return self._fallback_fn()(*args, **kwargs)

    def _key(self, leaves: list, spec) -> tuple | None:
        """The call's signature, or None when the graphs cannot take it."""
        if (torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch.is_autocast_enabled(self.device_type)
                or (self.device_type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return None
        devices = {x.device for x in leaves if isinstance(x, torch.Tensor)}
        if len(devices) != 1 or next(iter(devices)).type != self.device_type:
            return None
        try:
            return (spec, tuple(_leaf_key(x) for x in leaves))
        except TypeError:
            return None

    def _capture(self, entry: _Entry, compiled, call: tuple, caches: list) -> None:
        cache_tensors = entry.record(self._model(), caches)
        device = entry.static[0].device
        if any(t.device != device for t in entry.tensors + cache_tensors):
            raise RuntimeError("the model or its cache holds tensors on another device")
        args, kwargs = call
        entry.graph, output = self.capture(lambda: compiled(*args, **kwargs), device)
        if (isinstance(output, dict) and type(output) is not dict
                and not any(isinstance(v, (dict, list, tuple)) for v in output.values())):
            # a ModelOutput (an OrderedDict whose fields are also attributes) of leaves
            flat = list(output.values())
            entry.out_spec = (type(output), tuple(output), {
                k: v for k, v in output.__dict__.items() if k not in output})
        else:
            flat, entry.out_spec = pytree.tree_flatten(output, is_leaf=_is_cache)
        # the model's and the cache's memory is returned as it is; the graph's own (static
        # inputs included: the next call copies into them) is copied out
        external = {t.untyped_storage().data_ptr() for t in entry.tensors + cache_tensors}
        cache_ids = [id(c) for c in caches]
        entry.out_kind = [
            cache_ids.index(id(x)) if id(x) in cache_ids
            else "clone" if isinstance(x, torch.Tensor)
            and x.untyped_storage().data_ptr() not in external else "as is" for x in flat]
        entry.out_flat = [None if isinstance(k, int) else x
                          for x, k in zip(flat, entry.out_kind, strict=True)]
        self.stats["capture"] += 1

    @staticmethod
    def capture(fn, device):
        """``fn`` captured as a CUDA graph on ``device``: (graph, its output)."""
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    # -- copies and pickles hold the model, never a graph ----------------------------------
    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self._model(), memo), self._options)

    def __getstate__(self):
        return {"model": self._model(), "options": self._options}

    def __setstate__(self, state):
        self.__init__(state["model"], state["options"])
