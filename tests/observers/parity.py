"""Shared data and torch.ao settings for the observer parity tests."""

from __future__ import annotations

import torch

CHANNEL_AXIS = 1  # batches are [4, CHANNELS, 96]; axis 1 mimics [N, C, L] activations
CHANNELS = 6
KINDS = ["gaussian", "outliers", "positive", "dead_channel"]


def make_batches(kind: str, seed: int = 0) -> list[torch.Tensor]:
    """Four float32 batches of one kind; each later batch widens the range a little.

    - ``gaussian``: N(0.3, 1) scaled up per batch.
    - ``outliers``: gaussian with a few values 40x too large, on both sides.
    - ``positive``: all > 0 (post-ReLU/GELU-like); the affine zero point goes to qmin.
    - ``dead_channel``: gaussian with channel 2 exactly 0 (scale eps for that channel).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        x = torch.randn(4, CHANNELS, 96, generator=g) * (1.0 + 0.25 * i) + 0.3
        if kind == "outliers":
            idx = torch.randint(0, x.numel(), (3,), generator=g)
            x.view(-1)[idx] *= torch.tensor([40.0, -40.0, 25.0])
        elif kind == "positive":
            x = x.abs() * 2.0 + 0.05
        elif kind == "dead_channel":
            x[:, 2] = 0.0
        elif kind != "gaussian":
            raise ValueError(kind)
        out.append(x)
    return out


def torch_ao_args(symmetric: bool, per_channel: bool = False) -> dict:
    """torch.ao observer kwargs for qfuse's int8 activation convention ([-128, 127])."""
    if per_channel:
        qscheme = torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    else:
        qscheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    return {"dtype": torch.qint8, "qscheme": qscheme, "quant_min": -128, "quant_max": 127}


def assert_same_qparams(ours: tuple, reference: tuple) -> None:
    """Bitwise equal scales and zero points (torch.ao returns shape [1] for one tensor)."""
    (scale, zp), (ref_scale, ref_zp) = ours, reference
    torch.testing.assert_close(scale.reshape(-1), ref_scale.reshape(-1), rtol=0, atol=0)
    assert scale.dtype == torch.float32 and zp.dtype == torch.int32
    assert torch.equal(zp.reshape(-1).long(), ref_zp.reshape(-1).long()), (zp, ref_zp)
