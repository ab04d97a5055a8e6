"""A stage's quantized twin: the block as the converted model computes it, for
``calibrate_sequential(..., outputs="quantized")``.

Each fused layer's input is fake-quantized with the scale its observer chose (per token for a
dynamic config), each weight replaced by its quantized value (GPTQ's, else round to nearest
on convert's grid), GPTQ's Hessian recorders dropped. The next block is then calibrated on
what it will see after deployment (GPTQ's paper, AutoGPTQ); the scales no longer equal a
whole-model calibration's, and the twin runs in the model's float dtype, not through the int8
kernels, so it is a close simulation, not the converted model bit for bit.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qfuse.algorithms.gptq import round_layer
from qfuse.calibrate.stages import Stage
from qfuse.config import PerChannel
from qfuse.errors import UnsupportedError
from qfuse.flows.qat.fake_quant import (
    fake_quantize_activation,
    fake_quantize_per_token,
    fake_quantize_weight,
)
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.primitives import choose_qparams, weight_scale
from qfuse.state import get_state


class _InputFakeQuant(nn.Module):
    """A fused layer's input as its prologue quantizes it."""

    def __init__(self, scale, zero_point, dtype: torch.dtype, dynamic: bool) -> None:
        super().__init__()
        self.dtype, self.dynamic = dtype, dynamic
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        if self.dynamic:
            return fake_quantize_per_token(x, self.dtype)
        return fake_quantize_activation(x, self.scale, self.zero_point, self.dtype)


def _input_qparams(observer, fp8: bool):
    """Per-tensor qparams as convert takes them (symmetric for fp8)."""
    if observer.channel_axis is None and (observer.symmetric or not fp8):
        return observer.calculate_qparams()
    lo, hi = observer.value_range()
    return choose_qparams(lo.min(), hi.max(), symmetric=True)


def quantized_twin(prepared: fx.GraphModule, stage: Stage) -> fx.GraphModule:
    """``stage.module`` with quantization simulated (see the module docstring); reads the
    calibrated observers and cached GPTQ results, so build it after the stage is rounded."""
    state = get_state(prepared)
    if state.smoothed:
        raise UnsupportedError(
            "outputs='quantized' does not simulate SmoothQuant's smoothed layers; calibrate with "
            "outputs='float' (the default) or without SmoothQuant."
        )
    dtype, dynamic = state.config.dtype, state.config.is_dynamic
    mixed = [g for g, c in (getattr(state, "layer_configs", None) or {}).items()
             if c.is_dynamic != dynamic]
    if mixed:
        raise UnsupportedError(
            f"outputs='quantized' simulates one activation scheme for every layer, but "
            f"layer_configs {mixed} switch static/dynamic; calibrate with outputs='float' (the "
            "default)."
        )
    per_channel = isinstance(state.config.weight_granularity, PerChannel)
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.module.graph, {}))
    twin = fx.GraphModule(stage.module, graph, class_name=f"Quantized{type(stage.module).__name__}")
    observers, hessians = set(state.observers.values()), set(state.hessians.values())
    for i, node in enumerate(list(twin.graph.nodes)):
        if node.op != "call_module":
            continue
        if node.target in hessians:
            node.replace_all_uses_with(node.args[0])
            twin.graph.erase_node(node)
        elif node.target in observers:
            obs = prepared.get_submodule(node.target)
            scale, zp = (None, None) if dynamic else _input_qparams(obs, dtype != torch.int8)
            name = f"qfuse_input_quant_{i}"
            twin.add_submodule(name, _InputFakeQuant(scale, zp, dtype, dynamic))
            node.target = name
    weights = {c.weight: c for c in stage.chains}
    for i, node in enumerate(list(twin.graph.nodes)):
        if node.op != "get_attr" or node.target not in weights:
            continue
        chain = weights[node.target]
        w = attr_tensor(prepared, chain.weight).detach()
        scale = weight_scale(w.float(), dtype, per_channel)
        if chain.name in state.hessians:
            recorder = prepared.get_submodule(state.hessians[chain.name])
            q = round_layer(recorder, chain.name, w.float(), scale, dtype, state.gptq)
        else:
            q = fake_quantize_weight(w.float(), scale, dtype, per_channel)
        name = f"qfuse_quantized_weight_{i}"
        twin.register_buffer(name, q.to(w.dtype))
        node.target = name
    twin.graph.lint()
    twin.recompile()
    return twin
