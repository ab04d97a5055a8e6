"""Quantized Conv2d: qfuse's Triton conv kernels against cuDNN bf16 channels-last, same run.

    python -m bench.kernels.bench_conv --out $OUT/conv.json

Layers (ResNet-50 and MobileNetV3 shapes, N in 1/8/32/128): conv + folded BN + ReLU.
  bf16_eager / bf16_compile (cuDNN, channels-last; compile for COMPILED_LAYERS at N >= 32)
  qfuse (bf16 in -> bf16 out, activation quantized in the prologue)
  qfuse_q_io (int8/fp8 in -> int8/fp8 out: a layer inside a fused chain)
  every row also has graph_us (CUDA-graph replay median).
Whole networks (torchvision resnet18/50, mobilenet_v3_small): ``bench.models.conv_networks``
(GPU time, a per-family profile and a per-layer table per network).
Correctness before timing: each row's output is checked against a float32 reference first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench import harness as H
from qfuse.nn import QConv2d

FP8 = torch.float8_e4m3fn
QDTYPE = {"int8": torch.int8, "fp8": FP8}
MAX_ERR = {"bf16": 0.02, "int8": 0.06, "fp8": 0.1}
CL = torch.channels_last
# name: C_in, C_out, H (input), k, stride, groups
LAYERS = {
    "r50.l1.3x3": (64, 64, 56, 3, 1, 1),
    "r50.l1.1x1reduce": (256, 64, 56, 1, 1, 1),
    "r50.l1.1x1expand": (64, 256, 56, 1, 1, 1),
    "r50.l2.3x3s2": (128, 128, 56, 3, 2, 1),
    "r50.l3.3x3": (256, 256, 14, 3, 1, 1),
    "r50.l4.3x3": (512, 512, 7, 3, 1, 1),
    "r50.stem7x7s2": (3, 64, 224, 7, 2, 1),
    "mbv3.dw3x3s2": (16, 16, 112, 3, 2, 16),
    "mbv3.dw5x5": (96, 96, 14, 5, 1, 96),
    "mbv3.1x1": (96, 576, 7, 1, 1, 1),
}
NS = (1, 8, 32, 128)
# torch.compile costs seconds per shape: the layers the targets name (3x3 at N >= 32) and one
# 1x1 and one depthwise layer get a compiled baseline.
COMPILED_LAYERS = ("r50.l1.3x3", "r50.l3.3x3", "r50.l1.1x1reduce", "mbv3.dw5x5")


def layer_rows(name, spec, n, dtypes, rows):
    ci, co, h, k, s, g = spec
    x = torch.randn(n, ci, h, h, device="cuda").contiguous(memory_format=CL)
    w = torch.randn(co, ci // g, k, k, device="cuda") * (2.0 / (ci // g * k * k)) ** 0.5
    b = torch.randn(co, device="cuda") * 0.1
    ref = F.relu(F.conv2d(x, w, b, s, k // 2, 1, g)).double()
    flops = 2 * ref.numel() * (ci // g) * k * k
    xb, wb, bb = x.bfloat16(), w.bfloat16().contiguous(memory_format=CL), b.bfloat16()
    oh = ref.shape[-1]
    key = dict(layer=name, N=n, C_in=ci, C_out=co, H=h, OH=oh, k=k, stride=s, groups=g)

    def add(impl, dtype, fn, **kw):
        row = dict(key, impl=impl, dtype=dtype)
        rows.append(H.measure(row, fn, ref, flops, MAX_ERR[dtype], launches=False, graph=True,
                              **kw))

    def eager(xb=xb, wb=wb, bb=bb):
        return F.relu(F.conv2d(xb, wb, bb, s, k // 2, 1, g))

    add("bf16_eager", "bf16", eager)
    if n >= 32 and name in COMPILED_LAYERS:
        comp = torch.compile(eager, dynamic=False)
        add("bf16_compile", "bf16", comp)
    x_scale = x.abs().amax() / 127.5
    out_scale = ref.abs().amax().float() / 127.5
    for dtype in dtypes:
        to8 = 127.5 / 448.0 if dtype == "fp8" else 1.0
        common = dict(stride=[s, s], padding=[k // 2] * 2, dilation=[1, 1], groups=g,
                      x_scale=x_scale, x_zero_point=None, activation="relu", dtype=QDTYPE[dtype])
        q = QConv2d.from_float(w, b, out_dtype=torch.bfloat16, **{**common,
                                                                   "x_scale": x_scale * to8})
        add("qfuse", dtype, lambda q=q: q(xb))
        q_io = QConv2d.from_float(w, b, input_quantized=True, out_dtype=QDTYPE[dtype],
                                  out_scale=out_scale * to8, **{**common,
                                                                "x_scale": x_scale * to8})
        xq = (x * q_io.x_inv_scale).clamp(-448, 448)
        xq = xq.round().clamp(-128, 127).to(torch.int8) if dtype == "int8" else xq.to(FP8)
        xq = xq.contiguous(memory_format=CL)
        add("qfuse_q_io", dtype, lambda q=q_io, xq=xq: q(xq),
            to_float=lambda o, sc=out_scale * to8: o.float() * sc)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/conv.json")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--N", default=",".join(map(str, NS)))
    p.add_argument("--dtypes", default="int8,fp8")
    a = p.parse_args(argv)
    dtypes = a.dtypes.split(",")
    rows = []

    def save():
        H.add_ratios([r for r in rows if "layer" in r], ("layer", "N"))
        H.write_results(a.out, rows)

    for n in [int(v) for v in a.N.split(",") if v]:
        for name in [v for v in a.layers.split(",") if v]:
            layer_rows(name, LAYERS[name], n, dtypes, rows)
        save()
        print(f"layers done N={n}", flush=True)
    layer = [r for r in rows if "layer" in r]
    if layer:
        H.print_table(layer, ("layer", "N"))


if __name__ == "__main__":
    main()
