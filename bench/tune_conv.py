"""Schedules of the conv kernels on layer shapes (device check, not a result file).

    PYTHONPATH=. python bench/tune_conv.py [--quick]

For each shape: the int8 and fp8 chain case (quantized in -> quantized out, ReLU) under a few tile
schedules, against cuDNN bf16 channels-last conv + bias + ReLU; correctness of every schedule is
checked against the reference before it is timed. Prints the best schedule per shape.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from qfuse.kernels import conv
from qfuse.ops import reference

FP8 = torch.float8_e4m3fn
SHAPES = [  # N, C_in, C_out, H, k, stride, groups
    (32, 64, 64, 56, 3, 1, 1),
    (128, 256, 256, 14, 3, 1, 1),
    (32, 256, 64, 56, 1, 1, 1),
    (32, 64, 256, 56, 1, 1, 1),
    (32, 128, 128, 56, 3, 2, 1),
    (8, 512, 512, 7, 3, 1, 1),
    (32, 96, 96, 28, 5, 1, 96),
    (32, 3, 64, 224, 7, 2, 1),
]
GEMM = [conv.ConvConfig(*c) for c in [
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4), (256, 128, 64, 8, 3),
    (64, 64, 128, 4, 3), (128, 64, 128, 4, 3),
]]
DW = [conv.ConvConfig(*c) for c in [
    (32, 32, 0, 4, 1), (64, 64, 0, 4, 1), (32, 64, 0, 4, 1), (64, 32, 0, 4, 1),
    (128, 32, 0, 4, 1), (128, 64, 0, 8, 1), (16, 64, 0, 4, 1), (64, 128, 0, 4, 1),
]]


def us(fn):
    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def main(quick: bool) -> None:
    torch.manual_seed(0)
    shapes = SHAPES[:2] if quick else SHAPES
    for n, ci, co, h, k, s, g in shapes:
        x = torch.randn(n, ci, h, h, device="cuda").contiguous(memory_format=torch.channels_last)
        w = torch.randn(co, ci // g, k, k, device="cuda") * 0.05
        b = torch.randn(co, device="cuda")
        xb, wb = x.bfloat16(), w.bfloat16().contiguous(memory_format=torch.channels_last)
        bb = b.bfloat16()
        base = us(lambda: F.relu(F.conv2d(xb, wb, bb, s, k // 2, 1, g)))  # noqa: B023
        line = [f"N{n} C{ci}->{co} {h}x{h} k{k} s{s} g{g}: cudnn bf16 {base:7.1f} us"]
        for qd in (torch.int8, FP8):
            wq = conv.pack_weight((w * 2000).clamp(-127, 127).round().to(qd))
            xq = reference._quantize_input(x, torch.tensor(40.0, device="cuda"), None, qd)
            args = (xq, wq, torch.full((co,), 1e-4, device="cuda"), b, None, None, None,
                    torch.tensor(20.0, device="cuda"), None, "relu", qd, [s, s], [k // 2] * 2,
                    [1, 1], g)
            ref = reference.qconv2d(*[a.cpu() if torch.is_tensor(a) else a for a in args])
            best = None
            for cfg in (DW if g == ci and g > 1 else GEMM):
                try:
                    out = conv.qconv2d(*args, config=cfg)
                    diff = (out.cpu().float() - ref.float()).abs().max().item()
                    if qd == torch.int8 and diff != 0 or diff > 0.5 * ref.float().abs().max():
                        print(f"  WRONG {cfg} {qd}: {diff}")
                        continue
                    t = us(lambda cfg=cfg, a=args: conv.qconv2d(*a, config=cfg))
                except Exception as exc:  # noqa: BLE001 — a schedule that fails to compile
                    print(f"  fail {cfg}: {str(exc).splitlines()[0][:100]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            auto = us(lambda a=args: conv.qconv2d(*a))
            name = "int8" if qd == torch.int8 else "fp8"
            line.append(f"  {name}: auto {auto:7.1f} us ({base / auto:4.2f}x), best {best[0]:7.1f}"
                        f" us ({base / best[0]:4.2f}x) {best[1]}" if best else f"  {name}: none")
        print("\n".join(line), flush=True)


if __name__ == "__main__":
    main("--quick" in sys.argv)
