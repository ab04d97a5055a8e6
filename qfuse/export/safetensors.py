"""``qfuse.save`` / ``qfuse.load``: a converted model as one ``.safetensors`` file.

The file holds every tensor the converted graph reads — each fused module's buffers under
``<module path>.<buffer>`` (``encoder.layer.0.intermediate.dense.weight`` is int8) and the float
state that stayed float (LayerNorm, embeddings, unfused layers) under its usual name — plus JSON
metadata (``qfuse.export.format``). It does not hold the graph: ``load`` recaptures the float
architecture, which is deterministic (same capture, same BatchNorm folding, same chain names), and
rebuilds the fused modules from the file, so no calibration data is needed.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse._version import __version__
from qfuse.analysis.summary import summary
from qfuse.errors import FormatError
from qfuse.export.checks import converted_state, normalize_inputs
from qfuse.export.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    checksum,
    config_of,
    decode,
    encode,
    layer_entry,
    layer_record,
    pipeline_of,
    quantized_module_types,
    skipped_of,
)
from qfuse.export.tensors import (
    get_tensor,
    graph_tensors,
    set_tensor,
    split_aliases,
    to_cpu_unshared,
)
from qfuse.fileio import atomic_path
from qfuse.fusion.guards import add_runtime_guards
from qfuse.fusion.patterns import Chain
from qfuse.fusion.rewrite import module_paths
from qfuse.pipeline import CAPTURE, FUSED, PipelineOptions, mismatches, run_capture, run_fused
from qfuse.pipeline.capture import capture
from qfuse.pipeline.pickling import make_picklable
from qfuse.state import QFuseState, set_state


def save(qmodel: fx.GraphModule, path: str | os.PathLike) -> None:
    """Write the converted ``qmodel`` to ``path`` (``.safetensors``), atomically.

    Tensors are written from CPU copies, so a file saved from a CUDA model loads anywhere.
    Raises ``QFuseError`` if ``qmodel`` is not a converted model; after any failure the file at
    ``path`` is as it was before (absent or the previous version).

    Example:
        >>> import os, tempfile, torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> x = torch.randn(4, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
        >>> _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared)
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> qfuse.save(qmodel, path)
        >>> fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> loaded = qfuse.load(path, fresh, (x,))
        >>> torch.equal(loaded(x), qmodel(x))
        True
    """
    state = converted_state(qmodel, "qfuse.save")
    unique, aliases = split_aliases(graph_tensors(qmodel))
    tensors = to_cpu_unshared(unique)
    paths = module_paths(state.chains)
    chain_at = {p: name for name, p in paths.items()}
    kernels = {row["name"]: row["kernel"] for row in summary(qmodel).rows}
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "qfuse_version": __version__,
        "torch_version": torch.__version__,
        "config": state.config.to_dict(),
        "chains": [paths[c.name] for c in state.chains],
        "layers": [
            layer_entry(rec, chain_at[rec.name], qmodel.get_submodule(rec.name), kernels[rec.name])
            for rec in state.layers
        ],
        "skipped": [{"name": s.name, "kind": s.kind, "reason": s.reason} for s in state.skipped],
        "folded_batchnorms": list(state.folded_batchnorms),
        "merged": [list(g) for g in state.merged],
        "pipeline": (state.pipeline or PipelineOptions()).to_dict(),
        "passes": {name: list(record) for name, record in state.passes.items()},
        "aliases": aliases,
        "checksums": {name: checksum(t) for name, t in tensors.items()},
    }
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=encode(metadata))


def load(
    path: str | os.PathLike,
    float_model: nn.Module,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    device: str | torch.device | None = None,
    *,
    dynamic_shapes=None,
) -> fx.GraphModule:
    """Rebuild the quantized model saved at ``path`` onto ``float_model``'s architecture.

    ``float_model`` only supplies the architecture: every tensor the result uses comes from the
    file (its own weights may be random). ``example_inputs``/``example_kwargs`` (and
    ``dynamic_shapes``) are those given to ``qfuse.prepare``, or inputs of the same shapes.
    ``device`` (default: the float model's) is where the model is captured and its tensors put,
    so a file saved on CUDA loads on a CPU-only machine and the reverse. ``float_model`` is not
    modified (it is copied when ``device`` differs from its own).

    Raises ``FormatError`` for a truncated or corrupted file, a newer format version, a float
    model whose layers, tensor names, dtypes or shapes do not match the file (naming them).
    See ``save`` for an example.
    """
    path = os.fspath(path)
    meta, tensors = _read(path)
    config, skipped = config_of(meta, path), skipped_of(meta, path)
    target = torch.device(device) if device is not None else _device_of(float_model)
    options, recorded = pipeline_of(meta, path)
    gm = _capture_on(float_model, example_inputs, example_kwargs, dynamic_shapes, target)
    # The saved pipeline, its merges replayed exactly: the same chains as the saved graph.
    replay = recorded if recorded is not None else _legacy_replay(meta)
    captured = run_capture(gm, options, replay=replay)
    _check_replay(captured, recorded, CAPTURE, meta, path)
    chains = captured.chains
    paths = module_paths(chains)
    by_path = _match_layers(meta, chains, paths, path)
    modules, fused_names = _build_modules(gm, meta, by_path, tensors, target, path)
    fused = run_fused(gm, chains, modules, options)
    _check_replay(fused, recorded, FUSED, meta, path)
    add_runtime_guards(gm)  # as convert did: input checks, NaN/Inf marks (fusion.guards)
    _load_float_tensors(gm, meta, tensors, fused_names, target, path)
    # ``skipped`` is the saved list, not the recaptured one: it also holds the layers
    # convert(keep_float=) left float, with their reasons, so summary reads as before saving.
    layers = [layer_record(entry) for entry in meta["layers"]]
    folded = captured.records.get("fold_batchnorm", [])
    state = QFuseState(config, "converted", chains, skipped, {}, layers, folded_batchnorms=folded)
    state.merged, state.pipeline = captured.merged, options
    state.passes = {**captured.records, **fused.records}
    set_state(gm, state)
    return make_picklable(gm)


def _legacy_replay(meta: dict) -> dict[str, list]:
    """A file without pass records lists its merged groups together; each merge pass replays
    the groups it can make (a gate/up pair is no Q/K/V group, and the reverse)."""
    saved = [list(g) for g in meta.get("merged") or []]
    return {"merge_gated": saved, "merge_siblings": saved}


def _check_replay(run, recorded, stage: str, meta: dict, path: str) -> None:
    """Every pass of ``stage`` rewrote what it did before ``save`` (``FormatError`` if not)."""
    if recorded is None:  # an older file: only its merged list was saved
        saved = meta.get("merged") or []
        if stage == CAPTURE and sorted(map(sorted, run.merged)) != sorted(map(sorted, saved)):
            raise FormatError(
                f"{path}: the model merges sibling Linears {run.merged}, the file {saved}; load "
                "it into the float model it was saved from."
            )
        return
    for name, mine, theirs in mismatches(run.records, recorded, stage):
        raise FormatError(
            f"{path}: graph pass {name} rewrote {_names(sorted(map(str, theirs)))} when the "
            f"model was saved but {_names(sorted(map(str, mine)))} on this float model; load it "
            "into the float model it was saved from, with example inputs like those given to "
            "qfuse.prepare."
        )


# Reading ---------------------------------------------------------------------------------------
def _read(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Metadata and every tensor (on CPU), checked against the stored checksums."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            raw = f.metadata()
            meta = decode(raw, path)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as exc:
        raise FormatError(
            f"{path} is not a readable safetensors file ({exc}): it is truncated or corrupted. "
            "Re-save the model with qfuse.save."
        ) from None
    expected = meta["checksums"]
    if diff := _differ(sorted(expected), sorted(tensors), "missing", "not listed"):
        raise FormatError(
            f"{path} does not hold the tensors its metadata lists ({diff}); the file was "
            "modified after qfuse.save wrote it. Re-save it."
        )
    for name, tensor in tensors.items():
        if checksum(tensor) != expected[name]:
            raise FormatError(
                f"{path}: tensor {name} fails its checksum: the file is corrupted. Re-save it."
            )
    return meta, tensors


def _names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _differ(left: list[str], right: list[str], left_only: str, right_only: str) -> str:
    """The names only one side holds, each in its list's order (``"<left_only>: a, b;
    <right_only>: none"``), or the empty string when both hold the same names."""
    in_left, in_right = set(left), set(right)
    only_left = [n for n in left if n not in in_right]
    only_right = [n for n in right if n not in in_left]
    if not (only_left or only_right):
        return ""
    return f"{left_only}: {_names(only_left)}; {right_only}: {_names(only_right)}"


# Recapture -------------------------------------------------------------------------------------
def _device_of(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """True when ``a`` and ``b`` are one device (``cuda`` means the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return a.index == b.index or a.type == "cpu"
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def _capture_on(float_model, example_inputs, example_kwargs, dynamic_shapes, target):
    """Capture on ``target``: the captured graph bakes devices into ops (``arange(device=...)`` in
    BERT's mask code), so moving a captured model afterwards is not enough."""
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    if not _same_device(_device_of(float_model), target):
        with warnings.catch_warnings():  # deepcopy of modules holding pytree specs warns
            warnings.simplefilter("ignore", FutureWarning)
            float_model = copy.deepcopy(float_model).to(target)
        move = lambda v: v.to(target) if isinstance(v, torch.Tensor) else v
        args, kwargs = pytree.tree_map(move, (args, kwargs))
    return capture(float_model, args, kwargs, dynamic_shapes)


def _match_layers(meta: dict, chains: list[Chain], paths: dict, path: str) -> dict[str, Chain]:
    """The recaptured chain at each saved layer path; ``FormatError`` naming any mismatch."""
    found = [paths[c.name] for c in chains]
    if diff := _differ(
        meta["chains"],
        found,
        "layers in the file but not in the model",
        "fusible layers in the model but not in the file",
    ):
        raise FormatError(
            f"the float model does not match {path}: {diff}. Pass the float architecture the "
            "file was saved from (same module names), with example inputs like those given to "
            "qfuse.prepare."
        )
    by_path = {paths[c.name]: c for c in chains}
    for entry in meta["layers"]:
        chain = by_path.get(entry["name"])
        if chain is None:
            raise FormatError(
                f"{path}: layer {entry['name']} is not among the saved chains; "
                "the metadata is corrupted. Re-save the model."
            )
        if chain.pattern != entry["pattern"]:
            raise FormatError(
                f"layer {entry['name']}: {path} holds a fused {entry['pattern']} but the float "
                f"model computes {chain.pattern} there. Pass the float architecture the file was "
                "saved from."
            )
    return by_path


def _build_modules(gm, meta, by_path, tensors, target, path):
    """The fused module of every saved layer (by chain name), and the tensor names they own."""
    types = quantized_module_types()
    aliases = meta["aliases"]
    modules, owned = {}, set()
    for entry in meta["layers"]:
        name, chain, layout = entry["name"], by_path[entry["name"]], entry["layout"]
        cls = types.get(entry["module"])
        if cls is None:
            raise FormatError(
                f"layer {name} in {path} is a {entry['module']}, a module type this qfuse does not "
                f"have ({', '.join(sorted(types))}). Upgrade qfuse to load it."
            )
        buffers = {}
        for buf in layout["buffers"]:
            key = f"{name}.{buf}"
            if aliases.get(key, key) not in tensors:
                raise FormatError(
                    f"{path}: tensor {key} of layer {name} is missing; the file is "
                    "incomplete. Re-save the model."
                )
            buffers[buf] = tensors[aliases.get(key, key)].to(target)
            owned.add(key)
        if "weight" not in buffers:
            raise FormatError(f"{path}: layer {name} has no weight; the metadata is corrupted.")
        float_weight = get_tensor(gm, chain.weight)
        saved = tuple(buffers["weight"].shape)
        expected = tuple(float_weight.shape)
        if hasattr(cls, "stored_weight_shape"):  # packed weights (QLinear4)
            expected = cls.stored_weight_shape(expected)
        if saved != expected:
            raise FormatError(
                f"tensor {name}.weight has shape {saved} in {path} but the float model's "
                f"{chain.weight} has shape {tuple(float_weight.shape)}: the layer sizes differ. "
                "Pass the float architecture the file was saved from."
            )
        for key, value in (chain.conv or {}).items():
            if layout.get(key) != value:
                raise FormatError(
                    f"layer {name}: {key}={layout.get(key)} in {path} but {value} in the float "
                    "model. Pass the float architecture the file was saved from."
                )
        try:
            modules[chain.name] = cls.from_layout(layout, buffers)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(
                f"{path}: the layout of layer {name} cannot be read ({exc!r}); "
                "the metadata is corrupted or from another qfuse. Re-save it."
            ) from exc
    return modules, owned


def _load_float_tensors(gm, meta, tensors, fused_names, target, path) -> None:
    """Put the file's float tensors into ``gm``, after checking names, dtypes and shapes."""
    aliases = meta["aliases"]
    current = {n: t for n, t in graph_tensors(gm).items() if n not in fused_names}
    saved = {n for n in [*tensors, *aliases] if n not in fused_names}
    if diff := _differ(
        sorted(current),
        sorted(saved),
        "tensors in the model but not in the file",
        "tensors in the file but not in the model",
    ):
        raise FormatError(
            f"the float model does not match {path}: {diff}. Pass the float architecture the "
            "file was saved from."
        )
    for name, mine in current.items():
        theirs = tensors[aliases.get(name, name)]
        if theirs.dtype != mine.dtype:
            dtype = str(theirs.dtype).replace("torch.", "")
            raise FormatError(
                f"tensor {name} is {dtype} in {path} but {mine.dtype} in the float model. Cast "
                f"the float model like the saved one (e.g. float_model.to(torch.{dtype})) "
                "before qfuse.load."
            )
        if theirs.shape != mine.shape:
            raise FormatError(
                f"tensor {name} has shape {tuple(theirs.shape)} in {path} but "
                f"{tuple(mine.shape)} in the float model. Pass the float architecture the file "
                "was saved from."
            )
    for name in current:
        if name not in aliases:
            set_tensor(gm, name, tensors[name].to(target))
    for name in current:
        if name in aliases:
            set_tensor(gm, name, get_tensor(gm, aliases[name]))
