"""Calibration of a model whose parameters are on ``meta``, read from a safetensors checkpoint one
stage at a time: ``calibrate_sequential(prepared, batches, weights=<checkpoint>)``.

``qfuse.prepare`` captures a model built without data (``init_empty_weights`` below): export runs
on fake tensors, so a meta parameter captures as well as a real one. Then each stage reads the
tensors it needs from the checkpoint (a ``.safetensors`` file, a folder of shards or their
``model.safetensors.index.json``, as Hugging Face's ``save_pretrained`` writes them) just before
it runs, straight onto its device, and drops them after it: while the stages run, no parameter
outside the running one holds data.

A graph tensor is found in the checkpoint by name: export keeps the model's parameter names, the
merges ``prepare`` made at capture (Q/K/V concatenated, gate/up interleaved, recorded in
``state.passes``) are redone from their members' tensors, tied parameters (``lm_head.weight`` =
``model.embed_tokens.weight``) are found under any of their names, and empty tensors (qfuse's
device marker) need no data. Every meta tensor is checked against the checkpoint's headers (key,
shape, dtype) before the first stage runs, so a mismatch fails in seconds rather than hours in.

``qfuse.convert`` reads every float weight of the prepared model at once, so after the last stage
``restore`` puts them back on the CPU: a GPTQ-rounded weight shares the copy GPTQ's cache already
keeps to recognise its result (no second copy), the rest is read from the checkpoint again. Host
memory thus ends at the model once plus GPTQ's int8 codes; a model larger than host memory can
be calibrated but not converted until convert builds one layer at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from torch import fx, nn

from qfuse.errors import UnsupportedError, WeightsError
from qfuse.fusion.siblings import merged_path

INDEX = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@contextlib.contextmanager
def init_empty_weights():
    """Build a model whose parameters are on ``meta`` (no memory, no initialisation) and whose
    buffers are real, as accelerate's ``init_empty_weights()`` does: a buffer computed at
    construction (rotary ``inv_freq``) is not in a checkpoint, so ``torch.device("meta")``, which
    puts buffers on ``meta`` too, would leave it without values.

    Example:
        >>> import torch
        >>> with init_empty_weights():
        ...     norm = torch.nn.BatchNorm1d(4)
        >>> norm.weight.device.type, norm.running_var.device.type
        ('meta', 'cpu')
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            kwargs = {"requires_grad": p.requires_grad}
            if type(p) is not nn.Parameter:  # subclasses take their attributes as arguments
                kwargs.update(p.__dict__)
            on_meta = type(p)(p.to("meta"), **kwargs)
            on_meta.__dict__.update(p.__dict__)
            module._parameters[name] = on_meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _files(path: str) -> list[str]:
    """The safetensors files ``path`` names: itself, its index's, or a folder's."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            return _files(os.path.join(path, INDEX))
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise WeightsError(
                f"weights={path!r} is a folder without .safetensors files or {INDEX}; pass the "
                "folder save_pretrained wrote, its index.json or a .safetensors file."
            )
        return [os.path.join(path, f) for f in found]
    if not os.path.exists(path):
        raise WeightsError(
            f"weights={path!r} does not exist; pass a checkpoint folder, its "
            f"{INDEX} or a .safetensors file."
        )
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{path}: not a safetensors index (no weight_map: {exc}).") from exc
        folder = os.path.dirname(path)
        return [os.path.join(folder, f) for f in dict.fromkeys(weight_map.values())]
    if not path.endswith(".safetensors"):
        raise WeightsError(
            f"weights={path!r} is neither a folder, an index .json nor a .safetensors file."
        )
    return [path]


class Checkpoint:
    """Where each key of a safetensors checkpoint lives, with its shape and dtype (headers only;
    no tensor is read until ``read``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.file: dict[str, str] = {}
        self.header: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in _files(self.path):
            try:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys():
                        if key in self.file:
                            raise WeightsError(
                                f"{key} is in both {self.file[key]} and {file}; "
                                "pass the checkpoint's index.json."
                            )
                        s = f.get_slice(key)
                        self.file[key], self.header[key] = (
                            file,
                            (tuple(s.get_shape()), s.get_dtype()),
                        )
            except (OSError, SafetensorError) as exc:
                raise WeightsError(f"{file}: unreadable safetensors file ({exc}).") from exc

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` on the CPU, each file opened once."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file[key], []).append(key)
        out = {}
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for key in names:
                    out[key] = f.get_tensor(key)
        return out


@dataclass(frozen=True)
class Source:
    """How one graph tensor is built from the checkpoint: ``how`` is ``"key"`` (one tensor),
    ``"cat"`` (merged Q/K/V: rows concatenated), ``"interleave"`` (merged gate/up: rows
    alternate) or ``"empty"`` (no data). A part is a key, or the row count of zeros (a merged
    bias whose member has none)."""

    how: str
    parts: tuple[str | int, ...] = ()


def _merges(state) -> dict[str, tuple[str, list[str]]]:
    """Merged weight/bias target -> (how, member targets), from the state's merge records."""
    out = {}
    for record, how in (("merge_siblings", "cat"), ("merge_gated", "interleave")):
        for names in state.passes.get(record, []):
            path = merged_path(names)
            for leaf in ("weight", "bias"):
                out[f"{path}.{leaf}"] = (how, [f"{n}.{leaf}" for n in names])
    return out


def _tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    named = dict(gm.named_parameters(remove_duplicate=False))
    named.update(gm.named_buffers(remove_duplicate=False))
    return named


class ShardedWeights:
    """The meta tensors of a prepared model and how to read each from ``checkpoint``; builds
    (and checks) every source up front."""

    def __init__(self, prepared: fx.GraphModule, state, path: str | os.PathLike) -> None:
        self.ckpt = Checkpoint(path)
        if state.passes.get("fold_batchnorm"):
            raise UnsupportedError(
                "weights=: the prepared model folded BatchNorm into its convolutions at capture "
                f"({state.passes['fold_batchnorm'][:3]}), which a checkpoint cannot replay; "
                "load the model's weights and calibrate without weights=."
            )
        tensors = _tensors(prepared)
        meta = {name: t for name, t in tensors.items() if t.is_meta}
        if not meta:
            raise WeightsError(
                f"weights={self.ckpt.path!r}: no tensor of the prepared model is on meta, so "
                "there is nothing to read. Build the model under "
                "qfuse.calibrate.init_empty_weights(), or drop weights=."
            )
        names_of: dict[int, list[str]] = {}
        self.meta: dict[int, torch.Tensor] = {}  # id -> the meta tensor (kept: ids stay valid)
        for name, t in meta.items():
            names_of.setdefault(id(t), []).append(name)
            self.meta[id(t)] = t
        merges = _merges(state)
        self.sources: dict[int, Source] = {}
        self.names: dict[int, list[str]] = names_of
        for i, names in names_of.items():
            self.sources[i] = self._source(names, self.meta[i], merges)
        self.bind([prepared])

    def _where(self, key: str) -> str:
        return self.ckpt.file.get(key, self.ckpt.path)

    def _check(self, target: str, key: str, shape: tuple, dtype: torch.dtype) -> None:
        have_shape, have = self.ckpt.header[key]
        have_dtype = _DTYPES.get(have)
        if have_shape != tuple(shape):
            raise WeightsError(
                f"{key} in {self._where(key)} has shape {list(have_shape)}; the prepared "
                f"model's {target} needs {list(shape)}. Build the meta model from the "
                "checkpoint's own config."
            )
        if have_dtype != dtype:
            raise WeightsError(
                f"{key} in {self._where(key)} is {have} ({have_dtype}); the prepared model's "
                f"{target} is {dtype}. Build the meta model in the checkpoint's dtype "
                f"(model.to({have_dtype}) before qfuse.prepare)."
            )

    def _missing(self, target: str, looked: list[str]) -> WeightsError:
        hint = (
            " It is a buffer the model computes at construction: build the model under "
            "qfuse.calibrate.init_empty_weights() (parameters on meta, buffers real) instead of "
            "torch.device('meta')."
            if target.rsplit(".", 1)[-1].endswith("inv_freq")
            else " Build the meta model from the checkpoint's own config and class."
        )
        return WeightsError(
            f"the prepared model's {target} is on meta and not in the checkpoint {self.ckpt.path} "
            f"(looked for {looked}).{hint}"
        )

    def _source(self, names, t, merges) -> Source:
        if t.numel() == 0:
            return Source("empty")
        for name in names:
            if name in self.ckpt.file:
                self._check(name, name, t.shape, t.dtype)
                return Source("key", (name,))
        merged = next((n for n in names if n in merges), None)
        if merged is None:
            raise self._missing(names[0], names)
        how, keys = merges[merged]
        bias = merged.endswith(".bias")
        parts: list[str | int] = []
        for key in keys:
            if key in self.ckpt.file:
                parts.append(key)
            elif bias and key[: -len("bias")] + "weight" in self.ckpt.file:  # member without bias
                parts.append(self.ckpt.header[key[: -len("bias")] + "weight"][0][0])
            else:
                raise self._missing(f"{merged} (merged from {keys})", [key])
        rows = [self.ckpt.header[p][0][0] if isinstance(p, str) else p for p in parts]
        if how == "interleave" and len(set(rows)) != 1:
            raise WeightsError(
                f"{keys} in {self._where(keys[0])}: gate and up have {rows} rows; "
                f"the prepared model's {merged} interleaves equal halves."
            )
        for key, n in zip(parts, rows, strict=True):
            if isinstance(key, str):
                self._check(f"{merged} (rows of {key})", key, (n, *t.shape[1:]), t.dtype)
        if sum(rows) != t.shape[0]:
            raise WeightsError(
                f"{keys} in {self._where(keys[0])} have {sum(rows)} rows in all; "
                f"the prepared model's {merged} has {t.shape[0]}."
            )
        return Source(how, tuple(parts))

    def bind(self, roots: Iterable[nn.Module]) -> None:
        """Find every slot holding one of the meta tensors in ``roots`` (the prepared graph, its
        stages' modules, the user's model): loading puts the real tensor in all of them, since
        the meta one cannot take data in place (``.data =`` does not cross from ``meta``, and
        export's fake-tensor memo holds a weak reference that ``swap_tensors`` refuses)."""
        self.slots: dict[int, list[tuple[dict, str]]] = {i: [] for i in self.meta}
        seen = set()
        for root in roots:
            for module in root.modules():
                for table in (module._parameters, module._buffers):
                    for name, t in table.items():
                        if t is not None and id(t) in self.meta and (id(table), name) not in seen:
                            seen.add((id(table), name))
                            self.slots[id(t)].append((table, name))

    def place(self, tensors: Iterable[torch.Tensor], device) -> list[int]:
        """Read the meta ``tensors`` from the checkpoint onto ``device`` and put them in their
        slots; returns their ids, for ``release``."""
        ids = list(dict.fromkeys(id(t) for t in tensors if id(t) in self.meta))
        keys = [p for i in ids for p in self.sources[i].parts if isinstance(p, str)]
        read = self.ckpt.read(dict.fromkeys(keys))
        for i in ids:
            self._put(i, self._build(self.sources[i], self.meta[i], read, device))
        return ids

    def release(self, ids: Iterable[int]) -> None:
        """Put the meta tensors back in their slots: the data read by ``place`` is freed."""
        for i in ids:
            self._put(i, self.meta[i])

    def _put(self, i: int, value: torch.Tensor) -> None:
        meta = self.meta[i]
        if isinstance(meta, nn.Parameter) and not isinstance(value, nn.Parameter):
            value = type(meta)(value, requires_grad=meta.requires_grad)
        for table, name in self.slots[i]:
            table[name] = value

    @staticmethod
    def _build(source: Source, like: torch.Tensor, read: dict, device) -> torch.Tensor:
        if source.how == "empty":
            return torch.empty(like.shape, dtype=like.dtype, device=device)
        parts = [
            read[p] if isinstance(p, str) else torch.zeros(p, *like.shape[1:], dtype=like.dtype)
            for p in source.parts
        ]
        if source.how == "key":
            out = parts[0]
        elif source.how == "cat":
            out = torch.cat(parts)
        else:  # gate/up rows alternate: qfuse.fusion.gated
            out = torch.stack(parts, dim=1).flatten(0, 1)
        return out.to(device)

    def restore(self, solved: dict) -> None:
        """Put every tensor read from the checkpoint back, on the CPU, for ``qfuse.convert``.
        ``solved`` maps a weight's target to GPTQ's cached result for it
        (``qfuse.algorithms.gptq.Solved``), whose float weight the parameter then shares (so a
        weight edited in place between calibration and convert would not be seen as new:
        calibrate again after editing); the rest is read once more."""
        rest = []
        for i, meta in self.meta.items():
            hit = next((solved[n] for n in self.names[i] if n in solved), None)
            if hit is not None and hit.weight.shape == meta.shape:
                hit.weight = hit.weight.to(meta.dtype)  # equal values: the cache still matches
                self._put(i, hit.weight)
            else:
                rest.append(meta)
        self.place(rest, torch.device("cpu"))
