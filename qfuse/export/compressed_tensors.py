"""``qfuse.export_compressed_tensors``: a converted model as a compressed-tensors checkpoint, the
folder transformers (``from_pretrained``), vLLM and SGLang load as a W8A8 model.

The folder is what llm-compressor writes: ``config.json`` (the model's config plus a
``quantization_config``, ``ct_scheme``), ``model.safetensors`` with, per quantized Linear,
``weight`` (int8 / fp8), ``weight_scale``, ``input_scale`` / ``input_zero_point`` (static) and
``bias``, the float tensors under their usual names, and the generation config and tokenizer
when there are any. Merged Q/K/V and gate/up layers are written back as the separate projections
(``ct_layers``); an asymmetric layer's bias is written unfolded (qfuse folds the zero point's
correction into it). What the format cannot express raises ``UnsupportedError`` before anything
is written: a quantized conv or Conv1D, a SmoothQuant per-channel prologue.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import warnings

import torch
from safetensors.torch import save_file
from torch import fx, nn

from qfuse.errors import FormatError, QFuseError, UnsupportedError
from qfuse.export.ct_import import load_compressed_tensors
from qfuse.export.ct_layers import ct_linear, graph_slots, model_slots
from qfuse.export.ct_scheme import quantization_config
from qfuse.export.tensors import graph_tensors, to_cpu_unshared
from qfuse.state import get_state

__all__ = ["export_compressed_tensors", "load_compressed_tensors"]

WEIGHTS_NAME = "model.safetensors"


def export_compressed_tensors(
    qmodel: nn.Module,
    path: str | os.PathLike,
    *,
    float_model: nn.Module | None = None,
    tokenizer=None,
) -> None:
    """Write ``qmodel`` (``qfuse.convert``, graph or ``output="model"``, or ``qfuse.load``) as a
    compressed-tensors checkpoint folder at ``path``, atomically (an existing folder is replaced
    only once the new one is complete).

    ``float_model``: the transformers model ``qmodel`` was converted from. Needed for a model
    from ``qfuse.load``; otherwise qfuse uses the model ``prepare`` was given (graph) or builds
    the architecture from ``qmodel.config`` on the meta device (``output="model"``).
    ``tokenizer`` (anything with ``save_pretrained``) is saved beside the weights.

    Load the folder with ``transformers.AutoModelFor...from_pretrained(path)`` (needs
    ``compressed-tensors``), ``vllm serve path``, or back into qfuse with
    ``qfuse.load_compressed_tensors``. See the README section "Serving: vLLM / transformers".
    A 4-bit model (``QConfig.w4a16()``, ``output="model"``) is written as ``pack-quantized``
    (``export_compressed_tensors_w4``).

    Example:
        >>> import json, os, tempfile, torch, transformers, qfuse
        >>> config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
        ...                                  num_attention_heads=2, intermediate_size=64)
        >>> model = transformers.BertModel(config).eval()
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (ids,))
        >>> _ = prepared(ids)
        >>> qmodel = qfuse.convert(prepared)
        >>> folder = os.path.join(tempfile.mkdtemp(), "bert-w8a8")
        >>> qfuse.export_compressed_tensors(qmodel, folder)
        >>> qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
        >>> qc["format"], qc["config_groups"]["group_0"]["input_activations"]["strategy"]
        ('int-quantized', 'tensor')
        >>> back = qfuse.load_compressed_tensors(folder, (ids,))
        >>> torch.equal(back(ids)["last_hidden_state"], qmodel(ids)["last_hidden_state"])
        True
    """
    state = get_state(qmodel)
    if state is None or state.stage != "converted":
        got = "a prepared (not converted) model" if state else f"a {type(qmodel).__name__}"
        raise QFuseError(
            f"export_compressed_tensors expects a model returned by qfuse.convert or qfuse.load; "
            f"got {got}. Run qfuse.convert on the calibrated prepared model first."
        )
    if state.config.weight_bits == 4:  # compressed-tensors' pack_quantized form
        from qfuse.export.ct_int4 import export_compressed_tensors_w4

        export_compressed_tensors_w4(qmodel, path, tokenizer=tokenizer)
        return
    graph = isinstance(qmodel, fx.GraphModule)
    template = _template(qmodel, state, float_model, graph)
    slots = (graph_slots if graph else model_slots)(qmodel, state, template)
    linears = {}
    for slot in _progress(slots, "compressed-tensors"):
        bias = template.get_submodule(slot.name).bias is not None
        linears[slot.name] = ct_linear(slot, bias, asymmetric=not state.config.symmetric)
    groups: dict = {}
    for name, lin in linears.items():
        groups.setdefault(lin.scheme, []).append(name)
    float_linears = [
        n for n, m in template.named_modules() if isinstance(m, nn.Linear) and n not in linears
    ]
    by_class = len(groups) == 1
    qconfig = quantization_config(groups, float_linears, by_class=by_class)
    tensors = _float_tensors(qmodel, template, graph, set(linears))
    for name, lin in linears.items():
        tensors.update(lin.tensors(name))
    _write(path, template.config, qconfig, to_cpu_unshared(tensors), template, tokenizer)


def _template(qmodel, state, float_model, graph: bool) -> nn.Module:
    """A transformers model of ``qmodel``'s architecture: its layer names, biases and config."""
    if float_model is not None:
        model = float_model
    elif graph:
        if state.source is None:
            raise QFuseError(
                "export_compressed_tensors: this model came from qfuse.load and holds no float "
                "architecture; pass float_model= (the transformers model it was converted from; "
                "its weights are not used)."
            )
        model = state.source.model
    else:
        model = _without_absent(_meta_copy(qmodel), qmodel)
    if getattr(model, "config", None) is None or not hasattr(model.config, "save_pretrained"):
        raise UnsupportedError(
            f"export_compressed_tensors writes a Hugging Face model folder, and "
            f"{type(model).__name__} has no transformers config. Export transformers models "
            "(the checkpoint is loaded by class and config.json), or use qfuse.save."
        )
    return model


def _meta_copy(model: nn.Module) -> nn.Module:
    """The float architecture of a swapped model, built on the meta device (no memory)."""
    config = getattr(model, "config", None)
    if config is None:
        return model  # refused by the caller with the reason
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(model)(config)


def _without_absent(template: nn.Module, model: nn.Module) -> nn.Module:
    """``template`` (built from ``model.config``) without the modules ``model`` lacks: a module
    the config would build but the model was made without (``BertModel(config,
    add_pooling_layer=False)`` has ``pooler = None``) is left out of the export, not asked for.
    Only under a module ``model`` has unchanged (its own class there): a swapped module (a
    ``QGatedMLP`` for the MLP) holds its float layers under other names."""
    present = dict(model.named_modules())
    for name, child in list(template.named_modules()):
        parent, _, leaf = name.rpartition(".")
        holder = present.get(parent)
        if not name or holder is None or type(holder) is not type(template.get_submodule(parent)):
            continue
        if name not in present and child is not None:
            setattr(template.get_submodule(parent), leaf, None)
    return template


def _float_tensors(qmodel, template, graph: bool, quantized: set[str]) -> dict:
    """Every persistent tensor of the float model that is not a quantized Linear's weight or
    bias, read from ``qmodel`` (their values after conversion), tied copies left out as
    ``save_pretrained`` leaves them out."""
    if graph:
        held = graph_tensors(qmodel)
    else:
        held = dict(qmodel.named_parameters(remove_duplicate=False))
        held.update(qmodel.named_buffers(remove_duplicate=False))
    tied = getattr(template, "all_tied_weights_keys", None) or {}
    out, missing = {}, []
    for key in template.state_dict():
        owner, _, leaf = key.rpartition(".")
        if owner in quantized and leaf in ("weight", "bias"):
            if key in tied:
                raise UnsupportedError(
                    f"layer {owner}: its weight is tied to {tied[key]}, and qfuse quantized it. "
                    "Keep it float (keep_float) or untie the weights before quantizing."
                )
            continue
        if key in tied and tied[key] in held and held.get(key) is held[tied[key]]:
            continue  # transformers ties it again on load
        if key not in held:
            missing.append(key)
            continue
        out[key] = held[key].detach()
    if missing:
        raise FormatError(
            f"the converted model holds no tensor for {missing[:8]} of the float model; pass "
            "float_model= the model it was converted from."
        )
    return out


def _progress(items, desc):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not sys.stderr.isatty(), leave=False)


@contextlib.contextmanager
def _atomic_dir(path: str):
    """A temp folder beside ``path``, moved onto it when the block succeeds; an existing folder
    at ``path`` is replaced then (moved aside first, deleted after), never merged into."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise QFuseError(f"{path} is a file; export_compressed_tensors writes a folder.")
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.partial")
    os.mkdir(tmp)
    try:
        yield tmp
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.old")
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:
                os.replace(old, path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(path, config, qconfig: dict, tensors: dict, model, tokenizer) -> None:
    with _atomic_dir(os.fspath(path)) as tmp:
        config.save_pretrained(tmp)
        config_path = os.path.join(tmp, "config.json")
        with open(config_path) as f:
            data = json.load(f)
        data["architectures"] = [type(model).__name__]  # what save_pretrained records
        data["quantization_config"] = qconfig
        with open(config_path, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)
        if generation is not None and can_generate():
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
