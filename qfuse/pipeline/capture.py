"""Graph capture: ``torch.export`` (non-strict) of the float model, with dynamic batch and sequence
dimensions.

Why export and not ``torch.fx.symbolic_trace``: symbolic tracing fails on Hugging Face BERT
(data-dependent control flow on tensor values and shapes) and transformers 5 no longer ships an
fx tracer, while non-strict export runs the real Python with fake tensors, captures MiniLM in about
a second, keeps ``aten.linear`` un-decomposed with ``nn_module_stack`` naming each module, and
accepts symbolic (dynamic) dimensions, so one captured graph serves every batch size.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import sys
import warnings

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.errors import CaptureError, ShapeError, UnsupportedError
from qfuse.fusion.gemms import canonicalize_gemms
from qfuse.fusion.guards import guard_input_types
from qfuse.shapes import guard_inputs
from qfuse.validate import (
    check_example_tensors,
    check_gemm_input_dtypes,
    check_not_quantized,
    warn_pinned_batch,
)

# (major, minor) of the running torch: meta-weight capture needs 2.13 (see ``capture``).
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Mark every dimension of every tensor input as ``Dim.AUTO``: batch and sequence lengths stay
    free, and export pins each dimension the model forces (a feature size a Linear reads, an
    image size a position table fixes, an example size of 1). A later input of another size in a
    pinned dimension raises ``ShapeError`` naming it (see ``guard_inputs``)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return {d: torch.export.Dim.AUTO for d in range(value.dim())}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _own_storage(value):
    """A view as a tensor of its own (same values); anything else as it is."""
    if isinstance(value, torch.Tensor) and value._base is not None:
        return value.clone(memory_format=torch.contiguous_format)
    return value


def capture(
    model: nn.Module,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    *,
    training: bool = False,
) -> fx.GraphModule:
    """An ``fx.GraphModule`` of aten ops equivalent to ``model`` in eval mode (``training=True``:
    in train mode, for QAT: dropout and batch-statistics BatchNorm stay in the graph).

    Raises ``CaptureError`` naming the model and the likely fix when export fails.
    """
    kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    check_not_quantized(model)
    check_example_tensors(example_inputs, kwargs)
    if _TORCH < (2, 13) and any(p.is_meta for p in model.parameters()):
        raise UnsupportedError(
            f"{type(model).__name__} has its weights on meta: capturing it needs torch >= 2.13 "
            f"(torch {torch.__version__}'s FakeTensor cannot run meta weights with CPU inputs, "
            "e.g. aten.embedding); upgrade torch, or build the model on the CPU."
        )
    # Export guards a view input through its base (``input_ids._base.size()``): captured from a
    # slice of a batch, the graph then failed on every tensor that is not itself a view ("'NoneType'
    # object has no attribute 'size'"; torch 2.11's guards also pinned the slice's strides).
    example_inputs = pytree.tree_map(_own_storage, example_inputs)
    kwargs = pytree.tree_map(_own_storage, kwargs)
    modes = {m: m.training for m in model.modules()}  # the user's modes, restored below
    model.train(training)
    try:
        with without_cache(model, kwargs) as kwargs, quiet_torch_logs():
            dynamic_shapes_given = dynamic_shapes is not None
            if dynamic_shapes is None:
                dynamic_shapes = default_dynamic_shapes(model, example_inputs, kwargs)
            elif isinstance(dynamic_shapes, dict):  # without the cache inputs dropped above
                dropped = set(example_kwargs or {}) - set(kwargs)
                dynamic_shapes = {k: v for k, v in dynamic_shapes.items() if k not in dropped}
            program = torch.export.export(
                model, example_inputs, kwargs, dynamic_shapes=dynamic_shapes, strict=False
            )
    except Exception as exc:  # export raises many types; all mean "could not capture"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        eager_failure = _eager_failure(model, example_inputs, kwargs)
        if eager_failure is not None:
            raise ShapeError(
                f"{type(model).__name__} itself fails on the example inputs ({eager_failure}); "
                f"pass example inputs the float model runs on (got {_shapes(example_inputs)})."
            ) from None
        raise CaptureError(
            f"could not capture {type(model).__name__} with torch.export: {first_line}. "
            "Make the forward traceable (no data-dependent Python control flow on tensor values, "
            "no unsupported Python side effects), pass example inputs of the shapes you serve, or "
            "quantize the traceable submodule instead."
        ) from exc
    finally:
        for module, mode in modes.items():
            module.training = mode
    gm = program.module()
    check_gemm_input_dtypes(gm)
    warn_pinned_batch(gm, dynamic_shapes if dynamic_shapes_given else None)
    follow_input_device(gm)
    guard_inputs(gm, program.example_inputs)
    canonicalize_gemms(gm)
    guard_input_types(gm)  # another dtype or device: a QFuseError naming the input
    return gm


# Loggers that print export's shape specialisations ("0/1 specialized") and fake-tensor
# tracebacks of a failed capture on stderr; qfuse reports what matters as a warning or error.
_log = logging.getLogger(__name__)
_NOISY_LOGGERS = ("torch._export", "torch.export", "torch._subclasses.fake_tensor",
                  "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch._functorch")


@contextlib.contextmanager
def quiet_torch_logs():
    """Silence torch's capture logs unless asked for (``TORCH_LOGS`` or ``QFUSE_VERBOSE=1``).

    A failed export also prints its partial FX graph on stderr (``torch/export/_trace.py``, a
    plain ``print``: 20 lines for a two-op model) before the ``CaptureError`` that names the
    problem; that graph goes to the ``qfuse.pipeline.capture`` logger at DEBUG instead. Whatever
    else export writes on stderr (warnings) is passed on."""
    if os.environ.get("TORCH_LOGS") or os.environ.get("QFUSE_VERBOSE") == "1":
        yield
        return
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:  # children without a level of their own follow (effective level)
        lg.setLevel(logging.CRITICAL)
    stderr = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(stderr):
            # nn.LSTM's flat weights: export's advice is for the module's author, not our user
            warnings.filterwarnings("ignore", message=".*were assigned during export")
            yield
    except Exception as exc:
        graph = str(getattr(exc, "partial_fx_graph", "") or "")
        if graph and graph in stderr.getvalue():
            _log.debug("the partial graph of the failed capture:\n%s", graph)
            stderr = io.StringIO(stderr.getvalue().replace(graph + "\n", ""))  # printed twice
        raise
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)
        sys.stderr.write(stderr.getvalue().strip("\n") + "\n" if stderr.getvalue().strip() else "")


def _shapes(tree) -> str:
    return str(pytree.tree_map(
        lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, tree))


def _eager_failure(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """The float model's own error on the example inputs (a wrong shape or dtype), or None when
    it runs: then the capture, not the input, is the problem."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 — any error the model raises is the answer
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return None


@contextlib.contextmanager
def without_cache(model: nn.Module, kwargs: dict):
    """Capture a KV-cache model (transformers' ``use_cache`` / ``past_key_values`` / ``cache``)
    without its cache: cache objects (``DynamicCache``, ``EncoderDecoderCache``) are not tensors
    export can return, and the quantized layers are the same with or without one. Generation runs
    on ``qfuse.convert(prepared, output="model")``, the model's own class, whose forward keeps its
    caches. Yields the kwargs to capture with; every ``config.use_cache`` is restored afterwards.

    Every config in the model is switched off, not only the top one: T5's decoder stack holds a
    copy of the config and, given ``use_cache=None``, built an ``EncoderDecoderCache`` from it."""
    kwargs = dict(kwargs)
    # "cache": transformers 5's new name of past_key_values (T5); a tensor is a model's own input
    dropped = [k for k in ("past_key_values", "cache", "use_cache") if kwargs.get(k) is not None
               and not (k == "cache" and isinstance(kwargs[k], torch.Tensor))]
    for k in dropped:
        del kwargs[k]
    for name in [k for k in dropped if k != "use_cache"]:
        warnings.warn(
            f"qfuse.prepare: {name} was dropped; the graph is captured without a KV "
            "cache (qfuse.convert(prepared, output='model') keeps the model's cache handling).",
            stacklevel=4,
        )
    configs = {id(c): c for m in model.modules()
               if hasattr(c := getattr(m, "config", None), "use_cache")}
    saved = {key: config.use_cache for key, config in configs.items()}
    for config in configs.values():
        config.use_cache = False
    try:
        yield kwargs
    finally:
        for key, config in configs.items():
            config.use_cache = saved[key]


def _example_device(gm: fx.GraphModule) -> torch.device | None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device
    return None


def follow_input_device(gm: fx.GraphModule) -> int:
    """Make device constants in the captured graph follow the first tensor input's device.

    Export records the capture device in ops such as ``arange(..., device=cpu)``,
    ``to(device=cpu)`` and ``_assert_tensor_metadata``; left alone, a model captured (and
    converted) on CPU fails after ``.to("cuda")``. Every constant equal to the capture device is
    replaced by ``input.device`` at run time, and so is ``meta`` (a model captured with its
    parameters on ``meta``, to be calibrated from a checkpoint: ``qfuse.calibrate.shards``).
    Returns how many arguments were rewritten.
    """
    device = _example_device(gm)
    if device is None:
        return 0
    first_input = next(
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    device_node = None
    rewritten = 0

    def swap(value):
        nonlocal device_node, rewritten
        if isinstance(value, torch.device) and (value == device or value.type == "meta"):
            if device_node is None:
                last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
                with gm.graph.inserting_after(last_placeholder):
                    device_node = gm.graph.call_function(getattr, (first_input, "device"))
            rewritten += 1
            return device_node
        return value

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node is device_node:
            continue
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    if rewritten:
        gm.recompile()
    return rewritten


def inline_grad_wrappers(gm: fx.GraphModule) -> int:
    """Inline ``wrap_with_set_grad_enabled`` subgraphs into ``gm`` (in place), then make their
    device constants follow the input as ``follow_input_device`` does for the rest; returns how
    many were inlined. For inference graphs only: the ops then run under the caller's grad mode.

    torch 2.11's export wraps a ``with torch.no_grad():`` block of the model's forward (Llama's
    rotary embedding) in that higher-order op around a submodule with its own graph, out of
    ``follow_input_device``'s reach: a Llama converted on the CPU failed on the GPU with "Tensor
    device mismatch! Expected: cpu". On torch 2.13 the zoo's Llama captures without one, but
    the module of the example below still gets one.

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             y = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        ...         return x + y
        >>> x = torch.randn(2, 3)
        >>> gm = torch.export.export(M(), (x,), strict=False).module()
        >>> n = inline_grad_wrappers(gm)
        >>> gm(x.to("meta")).device.type
        'meta'
    """
    wrapper = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    inlined = 0
    for node in list(gm.graph.nodes):
        if wrapper is None or node.op != "call_function" or node.target is not wrapper:
            continue
        holder = node.args[1]
        sub = getattr(gm, holder.target) if isinstance(holder, fx.Node) else None
        if not isinstance(sub, fx.GraphModule) or any(
            n.op in ("get_attr", "call_module") for n in sub.graph.nodes
        ):
            continue  # attributes of its own: left wrapped
        users = list(node.users)
        if not all(u.target is operator.getitem for u in users):
            continue
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        env = dict(zip(placeholders, node.args[2:], strict=True))
        outputs = None
        with gm.graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    continue
                if sn.op == "output":
                    outputs = fx.node.map_arg(sn.args[0], env.__getitem__)
                    break
                env[sn] = gm.graph.node_copy(sn, env.__getitem__)
        for user in users:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not holder.users:
            gm.graph.erase_node(holder)
            delattr(gm, holder.target)
        inlined += 1
    if inlined:
        gm.recompile()
        follow_input_device(gm)
    return inlined
