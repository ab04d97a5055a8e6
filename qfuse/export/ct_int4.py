"""4-bit weights as compressed-tensors ``pack_quantized`` checkpoints (the W4A16 format
llm-compressor writes and vLLM and transformers read), both ways.

Per quantized Linear ``name`` the folder's safetensors hold ``name.weight_packed`` (int32
[N, ceil(K / 8)]: the codes as ``qfuse.int4`` packs them, which is compressed-tensors' own
packing), ``name.weight_scale`` ([N, G] group scales; [N, 1] per channel), ``name.weight_shape``
([N, K]) and, asymmetric, ``name.weight_zero_point`` (int32 [ceil(N / 8), G], packed along N).
qfuse's ``QLinear4`` stores exactly these codes and scales, so export and import are lossless.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qfuse import int4
from qfuse.errors import FormatError, UnsupportedError
from qfuse.export.ct_layers import Slot, quantized_slots
from qfuse.flows.build import precision4
from qfuse.flows.swap import float_facing
from qfuse.nn.qlinear4 import QLinear4
from qfuse.state import get_state

FORMAT = "pack-quantized"


def _slots(model: nn.Module, template: nn.Module) -> list[Slot]:
    slots = quantized_slots(model, get_state(model), template)
    for slot in slots:
        if not isinstance(slot.module, QLinear4):
            raise UnsupportedError(
                f"layer {slot.name} is a {type(slot.module).__name__}: "
                "export_compressed_tensors_w4 writes 4-bit layers only; export 8-bit models "
                "with qfuse.export_compressed_tensors.")
    return slots


def _scheme(mods: list[QLinear4]) -> dict:
    kinds = {(m.group_size, m.weight_zero_point is None, m.act_bits) for m in mods}
    if len(kinds) != 1:
        raise UnsupportedError(f"export_compressed_tensors_w4: the layers mix 4-bit schemes "
                               f"{sorted(kinds, key=str)}; convert with one QConfig.")
    ((group, symmetric, act_bits),) = kinds
    if act_bits != 16:
        raise UnsupportedError("export_compressed_tensors_w4 writes W4A16 (QConfig.w4a16()); "
                               "W4A8 layers have no pack_quantized form here.")
    return {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                    "strategy": "group" if group else "channel", "group_size": group,
                    "dynamic": False, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}, "block_structure": None},
        "input_activations": None,
        "output_activations": None,
        "format": FORMAT,
    }


def export_compressed_tensors_w4(qmodel: nn.Module, path: str | os.PathLike, *,
                                 tokenizer=None) -> None:
    """Write a 4-bit ``qfuse.convert(..., output="model")`` transformers model as a
    compressed-tensors ``pack_quantized`` folder at ``path`` (replaced only once complete).

    Load it with ``transformers.AutoModelForCausalLM.from_pretrained(path)`` (with
    ``compressed-tensors`` installed), vLLM, or ``load_compressed_tensors_w4``. Group sizes must
    divide every layer's input features (compressed-tensors' forward needs whole groups)."""
    if get_state(qmodel) is None or not hasattr(qmodel, "config"):
        raise UnsupportedError("export_compressed_tensors_w4 takes the transformers model "
                               "qfuse.convert(prepared, output='model') returns.")
    with torch.device("meta"):
        template = type(qmodel)(copy.deepcopy(qmodel.config))
    slots = _slots(qmodel, template)
    if not slots:
        raise UnsupportedError("export_compressed_tensors_w4: the model has no 4-bit layer.")
    scheme = _scheme([s.module for s in slots])
    tensors: dict[str, torch.Tensor] = {}
    for slot in slots:
        mod = slot.module
        if mod.group_size and mod.in_features % mod.group_size:
            raise UnsupportedError(
                f"layer {slot.name}: {mod.in_features} input features are not a whole number of "
                f"groups of {mod.group_size}; compressed-tensors cannot run a short last group. "
                "Quantize with a group size that divides every layer (SmolLM2: 64) or per "
                "channel (group_size=None).")
        b = mod._buffers
        scale = b["weight_scale"][slot.rows]
        tensors[f"{slot.name}.weight_packed"] = b["weight"][slot.rows].contiguous()
        tensors[f"{slot.name}.weight_scale"] = scale.contiguous()
        tensors[f"{slot.name}.weight_shape"] = torch.tensor([scale.shape[0], mod.in_features])
        if b["weight_zero_point"] is not None:
            tensors[f"{slot.name}.weight_zero_point"] = int4.pack_rows(
                b["weight_zero_point"][slot.rows].contiguous())
        if b["bias"] is not None:
            tensors[f"{slot.name}.bias"] = b["bias"][slot.rows].contiguous()
    quantized = {s.name for s in slots}
    seen = set()
    for key in template.state_dict():
        owner = key.rpartition(".")[0]
        if owner in quantized:
            continue
        value = qmodel.get_parameter(key) if key in dict(qmodel.named_parameters(
            remove_duplicate=False)) else qmodel.get_buffer(key)
        if value.untyped_storage().data_ptr() in seen:  # tied (lm_head): transformers re-ties
            continue
        seen.add(value.untyped_storage().data_ptr())
        tensors[key] = value.detach().cpu().contiguous()
    ignore = sorted(n for n, m in template.named_modules()
                    if isinstance(m, nn.Linear) and n not in quantized)
    config = qmodel.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": FORMAT,
        "quantization_status": "compressed", "config_groups": {"group_0": scheme},
        "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
    }
    path = os.fspath(path)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def _read(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}/config.json cannot be read ({exc}).") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FormatError(f"{path} holds no .safetensors file.")
    tensors = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return config, tensors


def _group_size(config: dict, path: str) -> tuple[int | None, bool]:
    qc = config.get("quantization_config") or {}
    groups = list((qc.get("config_groups") or {}).values())
    w = groups[0].get("weights") or {} if len(groups) == 1 else {}
    fmt = groups[0].get("format", qc.get("format")) if len(groups) == 1 else qc.get("format")
    ok = (qc.get("quant_method") == "compressed-tensors" and fmt == FORMAT
          and w.get("num_bits") == 4 and w.get("type") == "int"
          and w.get("strategy") in ("group", "channel")
          and not groups[0].get("input_activations"))
    if not ok:
        raise UnsupportedError(
            f"{path}: load_compressed_tensors_w4 reads one W4A16 pack_quantized config group "
            f"(4-bit int weights, group or channel strategy, no activation quantization); got "
            f"{json.dumps(qc)[:300]}. Load 8-bit checkpoints with qfuse.load_compressed_tensors.")
    group = w.get("group_size") if w["strategy"] == "group" else None
    return group, bool(w.get("symmetric", True))


def load_compressed_tensors_w4(path: str | os.PathLike) -> nn.Module:
    """A W4A16 ``pack_quantized`` checkpoint (llm-compressor's, or
    ``export_compressed_tensors_w4``'s) as its transformers model with ``QLinear4`` layers
    holding the file's codes and scales (the Triton W4A16 kernel on a GPU).

    The model carries a qfuse record of those layers: ``qfuse.summary`` lists them,
    ``save_pretrained`` writes qfuse's transformers format (``from_pretrained`` loads it back bit
    for bit) and ``export_compressed_tensors_w4`` writes pack_quantized again. ``qfuse.save``
    takes graphs only (``output="graph"``), which this loader does not build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(path)
    config, tensors = _read(path)
    group, symmetric = _group_size(config, path)
    names = sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    if not names:
        raise FormatError(f"{path}: no *.weight_packed tensor; not a pack_quantized checkpoint.")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(**plain)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    for name in names:
        try:
            float_linear = model.get_submodule(name)
        except AttributeError:
            float_linear = None
        if not isinstance(float_linear, nn.Linear):
            raise FormatError(f"{path}: {name} is quantized in the file but is not an nn.Linear "
                              f"of {type(model).__name__}.")
        n, k = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
        if (n, k) != (float_linear.out_features, float_linear.in_features):
            raise FormatError(f"{path}: {name} has shape {(n, k)} in the file, "
                              f"{(float_linear.out_features, float_linear.in_features)} in the "
                              "architecture config.json describes.")
        if f"{name}.weight_g_idx" in tensors:
            raise UnsupportedError(
                f"{path}: layer {name} has a weight_g_idx (actorder='group': each input column's "
                "group is looked up), which QLinear4's contiguous groups cannot run. Quantize "
                "with actorder 'static', 'weight' or None, which store no g_idx.")
        zp = tensors.pop(f"{name}.weight_zero_point", None)
        if symmetric != (zp is None):
            raise FormatError(f"{path}: {name}'s zero points do not match symmetric={symmetric}.")
        buffers = {
            "weight": tensors.pop(f"{name}.weight_packed").to(torch.int32),
            "weight_scale": tensors.pop(f"{name}.weight_scale").float(),
            "weight_zero_point": (int4.unpack_rows(zp, n) if zp is not None else None),
            "bias": tensors.pop(f"{name}.bias").float() if f"{name}.bias" in tensors else None,
        }
        layout = {"activation": "none", "out_dtype": "float32", "_input_quantized": False,
                  "in_features": k, "group_size": group, "act_bits": 16}
        layer = float_facing(QLinear4.from_layout(layout, buffers))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected:
        raise FormatError(f"{path}: tensors {unexpected[:5]} fit no parameter of "
                          f"{type(model).__name__}.")
    quantized_keys = {f"{n}.{b}" for n in names for b in ("weight", "weight_scale", "bias",
                                                            "weight_zero_point")}
    left = [k for k in missing if k not in quantized_keys and not k.startswith(
        tuple(f"{n}." for n in names))]
    tied = getattr(hf_config, "tie_word_embeddings", False)
    left = [k for k in left if not (tied and k == "lm_head.weight")]
    if left:
        raise FormatError(f"{path}: the file lacks {left[:5]} of {type(model).__name__}.")
    if tied:
        model.tie_weights()
    _give_record(model, names, group, symmetric, config, path)
    return model


def _give_record(model: nn.Module, names: list[str], group: int | None, symmetric: bool,
                 config: dict, path: str) -> None:
    """A qfuse record (``QConfig.w4a16`` of the file's scheme, one row per quantized Linear,
    the file's ``ignore`` list as float layers), then the hooks a ``convert(output="model")``
    result gets (``qfuse.integrations``: transformers' quantizer, decode graphs), so that
    ``save_pretrained`` writes qfuse's format (``from_pretrained`` gives the same layers back)
    and ``export_compressed_tensors_w4`` writes pack_quantized again. A plain transformers save
    would put the 4-bit buffers under a float config.json: a folder that loads as an unquantized
    model with random weights."""
    from qfuse.config import QConfig
    from qfuse.flows.hooks import AFTER_SWAP
    from qfuse.fusion.patterns import Skipped
    from qfuse.state import LayerRecord, QFuseState, set_state

    source = os.path.basename(os.path.abspath(path))
    note = f"read from the compressed-tensors checkpoint {source}"
    quantized = set(names)
    layers = [LayerRecord(name=n, pattern="Linear", kind="linear", precision=precision4(m),
                          input="float", output="float", note=note)
              for n, m in model.named_modules() if n in quantized]
    ignore = set((config.get("quantization_config") or {}).get("ignore") or [])
    skipped = [Skipped(name=n, kind="linear", reason=f"in the ignore list of {source}")
               for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in ignore]
    set_state(model, QFuseState(config=QConfig.w4a16(group, symmetric), stage="converted",
                                chains=[], skipped=skipped, layers=layers))
    for hook in AFTER_SWAP:
        hook(model)
