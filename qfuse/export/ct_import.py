"""``qfuse.load_compressed_tensors``: a compressed-tensors W8A8 checkpoint (as llm-compressor or
``qfuse.export_compressed_tensors`` write it) running on qfuse's fused kernels.

The float architecture (from ``config.json``'s ``architectures``, or the model you pass) goes
through ``qfuse.prepare`` as usual: capture, Q/K/V and gate/up merged, chains found. Its
observers are replaced by the checkpoint's input scales and a plan transform hands ``convert``
the checkpoint's weights and scales, so ``convert`` fuses exactly as it would after calibration
(epilogue activations, int8 hand-offs, LayerNorm + quantize). The weight codes are the file's:
re-imported from ``export_compressed_tensors``, the model runs bit for bit as the one exported.
Checks at the end compare every layer's codes and scales with the file (``ct_layers``).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import fx, nn
from torch.utils import _pytree as pytree

from qfuse.config import PerTensor, PerToken, QConfig
from qfuse.errors import FormatError, UnsupportedError
from qfuse.export.ct_layers import CTLinear, graph_slots, model_slots
from qfuse.export.ct_scheme import Scheme, matches, read_groups
from qfuse.flows.convert import convert
from qfuse.flows.prepare import prepare
from qfuse.fusion.graph_utils import find_submodule
from qfuse.fusion.patterns import GATED
from qfuse.fusion.siblings import merged_path
from qfuse.primitives import FP8_E4M3_MAX
from qfuse.state import get_state

# convert builds fp8 layers from int8-convention scales times this (``convert._build``).
_FP8_PER_INT8 = 127.5 / FP8_E4M3_MAX
_QPARAMS = ("weight", "weight_scale", "input_scale", "input_zero_point")


def load_compressed_tensors(
    path: str | os.PathLike,
    example_inputs,
    example_kwargs: dict | None = None,
    *,
    float_model: nn.Module | None = None,
    output: str = "graph",
    dynamic_shapes=None,
    merge_siblings: bool = True,
    fuse_norms: bool = True,
    device: str | torch.device | None = None,
) -> fx.GraphModule | nn.Module:
    """Load the compressed-tensors checkpoint folder ``path`` into qfuse's fused modules.

    ``example_inputs`` / ``example_kwargs`` / ``dynamic_shapes`` are what ``qfuse.prepare``
    takes (for a model exported by qfuse, those it was prepared with). ``float_model``: the
    architecture to load into (its tensors are replaced by the file's); by default the
    transformers class named in ``config.json`` is built. ``output``, ``fuse_norms`` as in
    ``qfuse.convert``; ``merge_siblings`` as in ``qfuse.prepare``. ``device`` (default: the
    float model's): where the model is captured and runs, example inputs moved there too
    (``"cuda"``: qfuse's Triton kernels).

    Runs the W8A8 schemes of ``ct_scheme``: int8 / fp8 weights per channel (or per tensor),
    activations static per-tensor (int8 also asymmetric) or dynamic per-token, one activation
    kind for the whole model; a ``pack-quantized`` W4A16 folder loads with ``output="model"``
    (``load_compressed_tensors_w4``). Anything else (other group-wise, block fp8, KV-cache
    quantization, sparse or packed weights) raises ``UnsupportedError`` naming the scheme.
    ``qfuse.export_compressed_tensors`` has an example of the round trip.
    """
    path = os.fspath(path)
    config, qc = _read_config(path)
    if qc.get("format") == "pack-quantized":  # 4-bit weights in groups (W4A16)
        if output != "model" or float_model is not None:
            raise UnsupportedError(
                f"{path} holds 4-bit packed weights: they load as the transformers model with "
                "4-bit layers; pass output='model' and no float_model."
            )
        from qfuse.export.ct_int4 import load_compressed_tensors_w4

        return load_compressed_tensors_w4(path)
    groups = read_groups(qc, path)
    tensors = _read_tensors(path)
    model = float_model if float_model is not None else _float_model(path, config)
    schemes = _assign(model, groups, qc.get("ignore") or [], tensors, path)
    layers = {n: _file_linear(n, s, tensors, model, path) for n, s in schemes.items()}
    _load_float(model, tensors, layers, path)
    if device is not None:
        model.to(device)
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        example_inputs, example_kwargs = pytree.tree_map(move, (example_inputs, example_kwargs))
    prepared = prepare(
        model,
        _qconfig(schemes, path),
        example_inputs,
        example_kwargs,
        dynamic_shapes,
        merge_siblings=merge_siblings,
    )
    state = get_state(prepared)
    merged = {merged_path(g): list(g) for g in state.merged}
    keep_float, dtypes, plan, notes = {}, {}, {}, {}
    for chain in state.chains:
        members = merged.get(chain.name, [chain.name])
        quantized = [m for m in members if m in layers]
        if not quantized:
            keep_float[chain.name] = "float in the compressed-tensors checkpoint"
            continue
        if len(quantized) != len(members):
            raise UnsupportedError(
                f"qfuse merged {members} into one GEMM, and the checkpoint quantizes only "
                f"{quantized}. Load with merge_siblings=False."
            )
        plan[chain.name] = _merge(
            [layers[m] for m in members], chain.activation in GATED, chain.name
        )
        dtypes[chain.name] = layers[members[0]].scheme.dtype
        notes[chain.name] = f"compressed-tensors: {layers[members[0]].scheme.describe()}"
    covered = {m for c in plan for m in merged.get(c, [c])}
    if set(layers) - covered:
        raise UnsupportedError(
            f"{path} quantizes {sorted(set(layers) - covered)[:8]}, which qfuse cannot capture "
            "as fused layers (qfuse.summary(qfuse.prepare(...)) lists what it can)."
        )
    for source, obs_name in state.observers.items():
        readers = [c.name for c in state.chains if c.input == source and c.name in plan]
        prepared.set_submodule(
            obs_name, _FileQParams(plan[readers[0]].x_qparams if readers else None)
        )
    state.plan_transforms = [_CheckpointPlan(plan)]
    qmodel = convert(
        prepared,
        keep_float=keep_float,
        layer_dtypes=dtypes,
        notes=notes,
        output=output,
        fuse_norms=fuse_norms,
    )
    slots = (graph_slots if output == "graph" else model_slots)(qmodel, get_state(qmodel), model)
    unswapped = sorted(set(layers) - {s.name for s in slots})
    if unswapped:
        raise UnsupportedError(
            f"{path} quantizes {unswapped[:8]}, which convert(output='model') could not swap "
            "(qfuse.summary says why); load with output='graph'."
        )
    _use_file_codes(slots, layers, path)
    return qmodel


# Reading the folder ---------------------------------------------------------------------------
def _read_config(path: str) -> tuple[dict, dict]:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"{file} cannot be read ({exc}): {path} is not a model folder.") from None
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise FormatError(f"{file} has no quantization_config: the checkpoint is not quantized.")
    return config, qc


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="pt", device="cpu") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        except (OSError, SafetensorError) as exc:
            raise FormatError(f"{path}/{name} cannot be read ({exc}).") from None
    return tensors


def _float_model(path: str, config: dict) -> nn.Module:
    import transformers

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise FormatError(
            f"{path}/config.json names no transformers architecture ({arch!r}); pass "
            "float_model= (the model class built from the config)."
        )
    hf_config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # the float architecture: qfuse quantizes it
    return cls(hf_config).eval()


def _assign(model, groups, ignore, tensors, path) -> dict[str, Scheme]:
    """The scheme of every Linear the checkpoint quantizes (compressed-tensors' matching)."""
    schemes = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(matches(name, module, i) for i in ignore):
            continue
        for scheme, targets in groups.values():
            if any(matches(name, module, t) for t in targets):
                schemes[name] = scheme
                break
    scaled = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")}
    if scaled - set(schemes):
        odd = sorted(scaled - set(schemes))[:8]
        found = [find_submodule(model, n) for n in odd]
        kinds = {"missing" if m is None else type(m).__name__ for m in found}
        raise UnsupportedError(
            f"{path} holds quantized weights for {odd} ({', '.join(sorted(kinds))}), which its "
            "quantization_config does not target (ignored, unmatched, or not nn.Linear layers: "
            "qfuse loads quantized nn.Linear layers only)."
        )
    if set(schemes) - scaled:
        raise FormatError(
            f"{path}: the quantization_config targets {sorted(set(schemes) - scaled)[:8]}, and "
            "the file holds no weight_scale for them: the checkpoint is incomplete."
        )
    return schemes


def _file_linear(name, scheme: Scheme, tensors, model, path) -> CTLinear:
    """Linear ``name``'s tensors from the file, checked and brought to qfuse's layout (scales
    float32 ``[out, 1]``, a per-tensor weight scale repeated per channel)."""
    weight = tensors[f"{name}.weight"]
    out = weight.shape[0]
    want = tuple(model.get_submodule(name).weight.shape)
    if weight.dtype != scheme.dtype or tuple(weight.shape) != want:
        raise FormatError(
            f"{path}: {name}.weight is {weight.dtype} {tuple(weight.shape)}; the scheme "
            f"({scheme.describe()}) and the model's Linear need {scheme.dtype} {want}."
        )
    w_scale = tensors[f"{name}.weight_scale"].float().reshape(-1, 1)
    if w_scale.shape[0] == 1:
        w_scale = w_scale.expand(out, 1).clone()
    x_scale, zp = tensors.get(f"{name}.input_scale"), tensors.get(f"{name}.input_zero_point")
    if (
        w_scale.shape[0] != out
        or (x_scale is None) != scheme.dynamic
        or (x_scale is not None and x_scale.numel() != 1)
        or (
            zp is not None
            and (zp.numel() != 1 or scheme.dynamic or (scheme.symmetric and zp.any()))
        )
    ):
        raise FormatError(
            f"{path}: the scales of {name} (weight_scale "
            f"{tuple(tensors[name + '.weight_scale'].shape)}, input_scale "
            f"{None if x_scale is None else tuple(x_scale.shape)}) do not fit its scheme, "
            f"{scheme.describe()}."
        )
    bias = tensors.get(f"{name}.bias")
    return CTLinear(
        scheme=scheme,
        weight=weight,
        weight_scale=w_scale,
        input_scale=x_scale.float().reshape(1) if x_scale is not None else None,
        input_zero_point=zp.to(torch.int8).reshape(1) if zp is not None and zp.any() else None,
        bias=bias.float() if bias is not None else None,
    )


def _load_float(model: nn.Module, tensors, layers: dict[str, CTLinear], path: str) -> None:
    """The file's tensors into the float model; quantized weights dequantized (what
    compressed-tensors' decompressor computes)."""
    state = {
        k: v
        for k, v in tensors.items()
        if k.rpartition(".")[0] not in layers or k.rpartition(".")[2] not in _QPARAMS
    }
    for name, lin in layers.items():
        state[f"{name}.weight"] = lin.weight.float() * lin.weight_scale
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise FormatError(
            f"{path} does not match the model: tensors missing from the file: {missing[:8]}; "
            f"tensors the model does not have: {result.unexpected_keys[:8]}."
        )


def _qconfig(schemes: dict[str, Scheme], path: str) -> QConfig:
    kinds = {s.dynamic for s in schemes.values()}
    if len(kinds) != 1:
        raise UnsupportedError(
            f"{path} mixes static and dynamic activation scales; qfuse runs one activation "
            "kind per model (QConfig.activation_granularity)."
        )
    int8 = [s for s in schemes.values() if s.dtype == torch.int8]
    return QConfig(
        dtype=torch.int8 if int8 else torch.float8_e4m3fn,
        activation_granularity=PerToken() if kinds.pop() else PerTensor(),
        symmetric=all(s.symmetric for s in int8),
    )


# Handing the file's numbers to convert --------------------------------------------------------
class _ChainTensors:
    """One fused layer's float weight (dequantized), bias, weight scale and input qparams."""

    def __init__(self, weight, bias, weight_scale, x_qparams) -> None:
        self.weight, self.bias, self.weight_scale = weight, bias, weight_scale
        self.x_qparams = x_qparams


def _merge(members: list[CTLinear], gated: bool, name: str) -> _ChainTensors:
    """Member Linears as prepare merged them: gate/up rows interleaved, Q/K/V concatenated."""
    join = (lambda ts: torch.stack(ts, dim=1).flatten(0, 1)) if gated else torch.cat
    keys = {
        (
            m.input_scale.item() if m.input_scale is not None else None,
            int(m.input_zero_point) if m.input_zero_point is not None else 0,
        )
        for m in members
    }
    if len(keys) != 1 or len({m.scheme for m in members}) != 1:
        raise UnsupportedError(
            f"layer {name}: its members have different schemes or input scales {sorted(keys)}, "
            "and qfuse runs them as one GEMM. Load with merge_siblings=False."
        )
    first = members[0]
    weight = join([m.weight.float() * m.weight_scale for m in members])
    scale = join([m.weight_scale.reshape(-1) for m in members])
    bias = None
    if any(m.bias is not None for m in members):
        bias = join(
            [m.bias if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in members]
        )
    qparams = None
    if first.input_scale is not None:
        s = first.input_scale.double().reshape(())
        if first.scheme.dtype == torch.float8_e4m3fn:
            s = s / _FP8_PER_INT8  # convert multiplies back, in float64: exactly the file's
        zp = first.input_zero_point
        qparams = (s, torch.tensor(int(zp) if zp is not None else 0, dtype=torch.int32))
    return _ChainTensors(weight, bias, scale, qparams)


class _FileQParams(nn.Module):
    """Where prepare's observer stood: the checkpoint's input qparams (the plan transform sets
    each reader's own; this answers for the first)."""

    channel_axis = None
    symmetric = True

    def __init__(self, qparams) -> None:
        super().__init__()
        self.qparams = qparams or (
            torch.ones((), dtype=torch.float64),
            torch.zeros((), dtype=torch.int32),
        )

    def forward(self, x):
        return x

    def calculate_qparams(self):
        return self.qparams

    def value_range(self):
        s = self.qparams[0].float()
        return -128 * s, 127 * s


class _CheckpointPlan:
    """Plan transform: every layer's weights, bias, weight scale and input qparams from the file."""

    def __init__(self, layers: dict[str, _ChainTensors]) -> None:
        self.layers = layers

    def apply(self, plan) -> None:
        for name, t in self.layers.items():
            if name not in plan.weights:
                continue
            device = plan.weights[name].device
            plan.weights[name] = t.weight.to(device)
            plan.biases[name] = t.bias.to(device) if t.bias is not None else None
            plan.weight_scales[name] = t.weight_scale.to(device)
            if t.x_qparams is not None:
                plan.x_qparams[name] = tuple(q.to(device) for q in t.x_qparams)


def _use_file_codes(slots, layers: dict[str, CTLinear], path: str) -> None:
    """Put the file's weight codes in the built layers where requantizing did not reproduce them
    (llm-compressor's int8 weights reach -128; qfuse rounds to [-127, 127]), re-folding an
    asymmetric layer's zero-point correction; then check every layer against the file."""
    redo = {}
    for slot in slots:
        file = layers[slot.name]
        mine = slot.module._buffers["weight"]
        if not torch.equal(mine[slot.rows].view(torch.int8), file.weight.view(torch.int8)):
            mine[slot.rows] = file.weight.to(mine.device)
            redo[id(slot.module)] = slot.module
    for module in redo.values():
        if module.x_zero_point is None:
            continue
        bias = torch.zeros(module.weight.shape[0], dtype=torch.float32)
        for slot in [s for s in slots if s.module is module]:
            if layers[slot.name].bias is not None:
                bias[slot.rows] = layers[slot.name].bias
        module.bias = bias.to(module.weight.device)
        module.weight_sum = module.weight.sum(dim=1, dtype=torch.int32)
        module._fold_zero_point()  # the fold from_float ran, on the file's codes
    for slot in slots:
        file, b = layers[slot.name], slot.module._buffers
        same = torch.equal(b["weight_scale"][slot.rows].reshape(-1, 1).cpu(), file.weight_scale)
        if file.input_scale is not None:
            same &= torch.equal(b["x_scale"].reshape(1).cpu(), file.input_scale)
            mine_zp, file_zp = b["x_zero_point"], file.input_zero_point
            same &= (int(mine_zp) if mine_zp is not None else 0) == (
                int(file_zp) if file_zp is not None else 0
            )
        if not same:
            raise FormatError(
                f"{path}: layer {slot.name} was built with scales other than the file's; this "
                "is a qfuse bug, please report it with the checkpoint's quantization_config."
            )
