"""The qfuse ``.safetensors`` metadata: schema, version check, checksums, module registry.

safetensors metadata is a ``str -> str`` map; qfuse stores one key, ``"qfuse"``, holding a JSON
object (see ``docs/export.md`` for every field)::

    {"format": "qfuse", "format_version": 2, "qfuse_version": "0.1.0", "torch_version": "...",
     "config": QConfig.to_dict(),
     "chains": [<module path of every fusible chain found at capture>],
     "layers": [{"name", "chain", "module", "pattern", "kind", "precision", "kernel",
                 "input", "output", "note", "layout": module.layout()}],
     "skipped": [{"name", "kind", "reason"}], "folded_batchnorms": [...],
     "merged": [[<member layer>, ...]], "pipeline": PipelineOptions.to_dict(),
     "passes": {"<graph pass>": <its record>},
     "aliases": {"<tied name>": "<saved name>"}, "checksums": {"<tensor>": crc32}}

A reader that sees a ``format_version`` above ``FORMAT_VERSION`` refuses the file: fields may have
changed meaning. Adding optional fields does not bump the version (``pipeline`` and ``passes``
are optional: a file without them was written before the options were saved, and loads with
the passes every qfuse then ran). Version 2: a Linear with
asymmetric int8 input stores its zero-point correction folded into ``bias`` and no
``weight_sum`` (``nn.QLinear._fold_zero_point``); version-1 files still load (folded on load).
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import torch

from qfuse.config import QConfig
from qfuse.errors import FormatError, QFuseError, check_version
from qfuse.fusion.patterns import Skipped
from qfuse.nn.base import QuantizedModule
from qfuse.pipeline import PipelineOptions
from qfuse.state import LayerRecord

METADATA_KEY = "qfuse"
FORMAT_NAME = "qfuse"
FORMAT_VERSION = 2
LAYER_KEYS = frozenset({"name", "chain", "module", "pattern", "layout"})


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes as stored (safetensors has no checksum of its own, so a flipped
    byte in the data section would otherwise load silently).

    Example:
        >>> checksum(torch.tensor([1, 2, 3], dtype=torch.int8))
        1438416925
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy())


def quantized_module_types() -> dict[str, type[QuantizedModule]]:
    """Every ``QuantizedModule`` subclass by class name (new module types register themselves
    by subclassing)."""
    found, todo = {}, list(QuantizedModule.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def layer_entry(record: LayerRecord, chain: str, module: QuantizedModule, kernel: str) -> dict:
    """One ``layers`` entry: the summary record plus what ``from_layout`` needs."""
    return {
        **dataclasses.asdict(record),
        "chain": chain,
        "module": type(module).__name__,
        "kernel": kernel,
        "layout": module.layout(),
    }


def layer_record(entry: dict) -> LayerRecord:
    """The ``LayerRecord`` stored in a ``layers`` entry (extra keys ignored)."""
    names = {f.name for f in dataclasses.fields(LayerRecord)}
    return LayerRecord(**{k: v for k, v in entry.items() if k in names})


def encode(metadata: dict) -> dict[str, str]:
    """The safetensors metadata map for ``metadata``."""
    return {METADATA_KEY: json.dumps(metadata, sort_keys=True)}


def decode(raw: dict[str, str] | None, path: str) -> dict:
    """Parse and check the metadata of the file at ``path``; raises ``FormatError``."""
    if not raw or METADATA_KEY not in raw:
        raise FormatError(
            f"{path} is a safetensors file without qfuse metadata (no {METADATA_KEY!r} key): "
            "it was not written by qfuse.save. Re-export the quantized model with qfuse.save."
        )
    try:
        meta = json.loads(raw[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise FormatError(
            f"{path}: the qfuse metadata is not valid JSON ({exc}); the file is corrupted, "
            "re-save it with qfuse.save."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{path}: the metadata does not describe a qfuse file; re-save it.")
    by = f" (written by qfuse {meta.get('qfuse_version', '?')})"
    check_version(
        meta.get("format_version"), FORMAT_VERSION, f"{path}: format_version", FormatError, by
    )
    missing = [k for k in ("config", "chains", "layers", "checksums") if k not in meta]
    if missing:
        raise FormatError(
            f"{path}: the metadata lacks {missing}; the file is corrupted, re-save it."
        )
    meta.setdefault("aliases", {})
    meta.setdefault("skipped", [])
    for entry in meta["layers"]:
        lacking = sorted(LAYER_KEYS - set(entry))
        if "buffers" not in entry.get("layout", {}):
            lacking.append("layout.buffers")
        if lacking:
            raise FormatError(
                f"{path}: layer entry {entry.get('name', '?')} lacks {lacking}; the metadata is "
                "corrupted, re-save the model."
            )
    return meta


def config_of(meta: dict, path: str) -> QConfig:
    """The saved ``QConfig`` (``FormatError`` if this qfuse cannot read it)."""
    try:
        return QConfig.from_dict(meta["config"])
    except (QFuseError, KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{path}: the saved QConfig cannot be read ({exc}).") from exc


def skipped_of(meta: dict, path: str) -> list[Skipped]:
    """The saved list of layers left float, with reasons."""
    try:
        return [Skipped(s["name"], s["kind"], s["reason"]) for s in meta["skipped"]]
    except (KeyError, TypeError) as exc:
        raise FormatError(f"{path}: the skipped-layer list is malformed ({exc!r}).") from exc


def pipeline_of(meta: dict, path: str) -> tuple[PipelineOptions, dict[str, list] | None]:
    """The saved ``PipelineOptions`` and pass records. A file saved before they were recorded
    gets the passes ``load`` ran then (both merges if it lists merged layers, norm and pool
    fusion) and ``None`` records: only its ``merged`` list can be checked."""
    if "pipeline" not in meta:
        merged = bool(meta.get("merged"))
        return PipelineOptions(merge_gated=merged, merge_siblings=merged), None
    try:
        options = PipelineOptions.from_dict(meta["pipeline"])
        passes = meta.get("passes", {})
        if not isinstance(passes, dict) or not all(isinstance(r, list) for r in passes.values()):
            raise TypeError(f"passes must map pass names to lists, got {passes!r}")
    except (QFuseError, KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{path}: the saved pipeline options cannot be read ({exc}).") from exc
    return options, passes
