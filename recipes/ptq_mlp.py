"""A transformer MLP block ``x + W2 GELU(W1 x + b1) + b2`` as a sweep recipe (the bench_mlp shape).

    qfuse sweep --recipe mlp

Random weights (nn.Linear's init) and synthetic activations with a few outlier channels (x20),
as LLM hidden states have — the case SmoothQuant exists for. The metric is the relative L2 error
of the block's output against fp32 (lower is better), on batches calibration never saw. On CUDA
the block is d=1024, h=4096 and the example batch 2048 tokens; on CPU d=256, h=1024, 256 tokens.
"""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def activations(n: int, d: int, generator: torch.Generator, outliers: int = 4) -> torch.Tensor:
    """``n`` tokens of width ``d``; the first ``outliers`` channels 20x larger."""
    x = torch.randn(n, d, generator=generator)
    x[:, :outliers] *= 20.0
    return x


@torch.no_grad()
def relative_error(model, batches: list, references: list) -> float:
    """||out - ref|| / ||ref|| over all batches, in percent."""
    num = den = 0.0
    for x, ref in zip(batches, references, strict=True):
        out = model(x).double()
        num += (out - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return 100.0 * (num / den) ** 0.5


def sweep_spec(reduced: bool = False, seed: int = 0):
    """The MLP block as a ``qfuse sweep`` recipe.

    Example:
        >>> spec = sweep_spec(reduced=True)
        >>> spec.metric, spec.higher_is_better, spec.evaluate(spec.model)
        ('relative error vs fp32 (%)', False, 0.0)
    """
    from qfuse.tools import SweepSpec

    gpu = torch.cuda.is_available() and not reduced
    d, h, tokens = (1024, 4096, 2048) if gpu else ((64, 256, 32) if reduced else (256, 1024, 256))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = MLPBlock(d, h).eval()
    calib = [activations(tokens, d, g) for _ in range(2 if reduced else 8)]
    valid = [activations(tokens, d, g) for _ in range(2)]
    held = [activations(tokens, d, g) for _ in range(2 if reduced else 4)]
    with torch.no_grad():
        ref_valid = [model(x).double() for x in valid]
        ref_held = [model(x).double() for x in held]
    return SweepSpec(
        name="mlp",
        model=model,
        calibration=calib,
        evaluate=lambda m: relative_error(m, held, ref_held),
        validate=lambda m: relative_error(m, valid, ref_valid),
        example=held[0],
        metric="relative error vs fp32 (%)",
        higher_is_better=False,
        default_max_drop=1.0,  # percentage points of relative error
        description=(
            f"Transformer MLP block x + W2 GELU(W1 x + b1) + b2, d={d}, h={h}, random weights, "
            f"synthetic activations with 4 outlier channels (x20): relative L2 error of the output "
            f"vs fp32 on {len(held)} held-out batches of {tokens} tokens; latency: one forward of "
            f"{tokens} tokens."
        ),
    )
