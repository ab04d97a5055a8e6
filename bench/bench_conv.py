"""Quantized Conv2d: qfuse's Triton conv kernels against cuDNN bf16 channels-last, same run.

    PYTHONPATH=. python bench/bench_conv.py --out bench/results/conv_h200.json

Layers (ResNet-50 and MobileNetV3 shapes, N in 1/8/32/128): conv + folded BN + ReLU.
  bf16_eager / bf16_compile (cuDNN, channels-last; compile for COMPILED_LAYERS at N >= 32)
  qfuse (bf16 in -> bf16 out, activation quantized in the prologue)
  qfuse_q_io (int8/fp8 in -> int8/fp8 out: a layer inside a fused chain)
  every row also has graph_us (CUDA-graph replay median).
Networks (torchvision resnet18, resnet50, mobilenet_v3_small, random weights with BatchNorm
statistics re-estimated on random data, 224x224, batch 1/32/128): bf16 eager, bf16 compile
(dynamic batch: one compile) and
qfuse int8/fp8 (prepared from the bf16 model), all CUDA-graphed, plus a torch.profiler breakdown
of one qfuse forward per network (GPU time per kernel family).
Correctness before timing: each row's output is checked against a float32 reference first.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import harness as H  # noqa: E402

import qfuse  # noqa: E402
from qfuse.nn import QConv2d  # noqa: E402

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
NETS = ("resnet50", "resnet18", "mobilenet_v3_small")
BATCHES = (32, 128, 1)


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


def reestimate_bn(model, batch, steps=3):
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(batch, 3, 224, 224, device="cuda"))
    return model.eval()


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def profile(fn) -> list[dict]:
    """GPU time per kernel name over one call (top 10), from torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = times.setdefault(e.name[:80], [0.0, 0])
            t[0] += e.device_time_total
            t[1] += 1
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:10]
    return [dict(kernel=k, us=round(v[0], 1), calls=v[1]) for k, v in top]


def network_rows(name, batches, dtypes, rows, profiles):
    import torchvision

    torch.manual_seed(0)
    model = reestimate_bn(getattr(torchvision.models, name)(weights=None).cuda(), 16)
    ref_model = copy.deepcopy(model)  # float32: the reference
    model = model.to(torch.bfloat16).to(memory_format=CL)
    comp = torch.compile(model, dynamic=True)  # one compile serves every batch size
    calib = [torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    qmodels = {}
    for dtype in dtypes:
        t0 = time.time()
        cfg = qfuse.QConfig.int8_static() if dtype == "int8" else qfuse.QConfig.fp8_static()
        prepared = qfuse.prepare(model, cfg, example_inputs=(calib[0],))
        with torch.no_grad():
            for c in calib:
                prepared(c)
        qmodels[dtype] = qfuse.convert(prepared)
        print(f"{name} {dtype}: prepared+converted in {time.time() - t0:.1f}s", flush=True)
    for batch in batches:
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
        x = x.contiguous(memory_format=CL)
        with torch.no_grad():
            ref = ref_model(x.float()).double()
            impls = [("bf16_eager", "bf16", model), ("bf16_compile", "bf16", comp)]
            impls += [(f"qfuse_{d}", d, qmodels[d]) for d in dtypes]
            for impl, dtype, m in impls:
                row = dict(network=name, batch=batch, impl=impl, dtype=dtype)
                try:
                    out = m(x)
                    row["rel_err_vs_fp32"] = H.rel_err(out.float(), ref)
                    row["top1_agree_fp32"] = (out.argmax(1) == ref.argmax(1)).float().mean().item()
                    row["eager_us"] = do_bench(lambda m=m, x=x: m(x), warmup=3, rep=20,
                                               return_mode="median") * 1e3
                    row["graph_us"] = graph_us(lambda m=m, x=x: m(x))
                except Exception as exc:  # noqa: BLE001 — a failing row is a result
                    row["error"] = H.error_text(exc)
                rows.append(row)
                print(row, flush=True)
            if batch == 32:
                for impl, m in [("bf16_eager", model)] + [(f"qfuse_{d}", qmodels[d])
                                                          for d in dtypes]:
                    try:
                        profiles[f"{name}/{impl}/b{batch}"] = profile(lambda m=m, x=x: m(x))
                    except Exception as exc:  # noqa: BLE001
                        profiles[f"{name}/{impl}/b{batch}"] = [dict(error=H.error_text(exc))]
    base = {(r["network"], r["batch"]): r.get("graph_us") for r in rows
            if r.get("impl") == "bf16_compile" and "network" in r}
    for r in rows:
        b = base.get((r.get("network"), r.get("batch")))
        if b and r.get("graph_us"):
            r["x_bf16_compile_graphed"] = b / r["graph_us"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/conv.json")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--N", default=",".join(map(str, NS)))
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--dtypes", default="int8,fp8")
    a = p.parse_args(argv)
    dtypes = a.dtypes.split(",")
    rows, profiles = [], {}

    def save():
        H.add_ratios([r for r in rows if "layer" in r], ("layer", "N"))
        H.write_results(a.out, rows)
        with open(a.out) as f:
            data = json.load(f)
        data["profiles"] = profiles
        with open(a.out, "w") as f:
            json.dump(data, f, indent=1)

    for n in [int(v) for v in a.N.split(",") if v]:
        for name in [v for v in a.layers.split(",") if v]:
            layer_rows(name, LAYERS[name], n, dtypes, rows)
        save()
        print(f"layers done N={n}", flush=True)
    layer = [r for r in rows if "layer" in r]
    if layer:
        H.print_table(layer, ("layer", "N"))
    for name in [v for v in a.nets.split(",") if v]:
        try:
            network_rows(name, [int(b) for b in a.batches.split(",")], dtypes, rows, profiles)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(network=name, error=H.error_text(exc)))
        save()
    print(f"{'network':>20} {'batch':>5} {'impl':>14} {'eager_us':>9} {'graph_us':>9} "
          f"{'x_comp':>6} {'relerr':>7} {'top1':>5}")
    for r in rows:
        if "network" in r and "graph_us" in r:
            print(f"{r['network']:>20} {r['batch']:5d} {r['impl']:>14} {r['eager_us']:9.1f} "
                  f"{r['graph_us']:9.1f} {r.get('x_bf16_compile_graphed', 0):6.2f} "
                  f"{r['rel_err_vs_fp32']:7.3f} {r['top1_agree_fp32']:5.2f}")
        elif "network" in r:
            print(f"{r['network']:>20} {r.get('batch', '')!s:>5} {r.get('impl', '')!s:>14} "
                  f"{r.get('error', '')[:90]}")
    for key, prof in profiles.items():
        print(key)
        for p_ in prof[:6]:
            print(f"   {p_}")


if __name__ == "__main__":
    main()
