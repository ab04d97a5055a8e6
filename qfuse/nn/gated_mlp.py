"""QGatedMLP: a gated MLP (``down(act(gate(x)) * up(x))``, Llama's, Mistral's, Qwen2's) swapped
into a user's model whole, so the gate/up GEMM keeps its fused gated epilogue."""

from __future__ import annotations

from torch import nn

from qfuse.nn.qlinear import QLinear


class QGatedMLP(nn.Module):
    """``down(gate_up(x))``: ``gate_up`` is one GEMM over interleaved gate/up rows whose epilogue
    computes ``act(gate) * up`` (and, with static scales, quantizes it for ``down``).

    ``convert(output="model")`` puts it where the model's MLP module was, when the captured graph
    shows that module's forward is exactly that product (``qfuse.flows.swap``).

    Example:
        >>> import torch
        >>> w, x = torch.randn(8, 4), torch.randn(2, 4)          # 4 gate/up pairs, interleaved
        >>> gate_up = QLinear.from_float(w, None, x_scale=None, x_zero_point=None,
        ...                              activation="swiglu")
        >>> down = QLinear.from_float(torch.randn(4, 4), None, x_scale=None, x_zero_point=None)
        >>> QGatedMLP(gate_up, down)(x).shape
        torch.Size([2, 4])
    """

    def __init__(self, gate_up: QLinear, down: QLinear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x):
        return self.down(self.gate_up(x))
