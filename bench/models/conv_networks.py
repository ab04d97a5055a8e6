"""Whole CNNs: where the time goes, qfuse int8/fp8 against bf16 channels-last, same run.

    python -m bench.models.conv_networks --out $OUT/conv_networks.json
    python -m bench.models.conv_networks --tiny --batches 2   # CPU smoke test

torchvision resnet18, resnet50, mobilenet_v3_small (random weights; BatchNorm statistics
re-estimated on random data in train mode, so activations are O(1)), 224x224. Per batch size:
  bf16_eager, bf16_compile (torch.compile, dynamic batch): cuDNN channels-last, what a user runs
  qfuse_<dtype> (the converted graph, eager) and qfuse_<dtype>_compile (torch.compile of it)
every row timed as GPU time (``tuning.device_time_ms``: CUDA-graph replays; an eager Triton launch
costs 50-100 us of host time, more than most layers), plus do_bench of one eager call.
A profile per network (batch ``--profile-batch``): GPU time and kernel count per family
(quantized conv, quantize, pooling, float conv, GEMM, elementwise, other), and a per-layer
table: each fused conv timed on its own recorded input against cuDNN bf16 (conv + bias) on the
same shapes, so a network's gap can be read off layer by layer.
Correctness first: each row's output is compared with the float32 model's (relative error and
top-1 agreement).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

import qfuse
from bench import harness as H
from qfuse.nn import QConv2d

CL = torch.channels_last
NETS = ("resnet50", "resnet18", "mobilenet_v3_small")
CONFIGS = {"int8": qfuse.QConfig.int8_static, "fp8": qfuse.QConfig.fp8_static}
FAMILIES = (  # first match wins: (family, substrings of the kernel name)
    ("quantized conv", ("_qconv_kernel", "_dwconv_kernel", "_im2col_kernel", "_stem_kernel",
                        "_conv1x1_tma_kernel")),
    ("quantize", ("_prequantize_kernel", "quantize")),
    ("pooling", ("pool", "mean", "reduce_kernel", "triton_red", "triton_per")),
    ("float conv", ("fprop", "conv", "xmma", "cutlass", "implicit")),
    ("gemm", ("_qlinear", "gemm", "nvjet", "sm90_")),
    ("elementwise", ("elementwise", "batch_norm", "triton_poi", "copy", "_fused_")),
)


def family(kernel: str) -> str:
    low = kernel.lower()
    for name, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return name
    return "other"


def gpu_us(fn) -> float:
    """GPU time of one call (CUDA-graph replays); wall time on CPU (smoke tests only)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from qfuse.kernels.tuning import device_time_ms

    return device_time_ms(fn, calls=4, replays=7) * 1e3


def eager_us(fn) -> float:
    if not torch.cuda.is_available():
        return gpu_us(fn)
    from triton.testing import do_bench

    return do_bench(fn, warmup=3, rep=20, return_mode="median") * 1e3


def breakdown(fn) -> dict:
    """GPU time and kernel count per kernel family over one call, and the top kernels."""
    if not torch.cuda.is_available():
        return {}
    fams: dict[str, list] = {}
    kernels: dict[str, list] = {}
    for name, us in H.cuda_kernels(fn):
        for table, key in ((fams, family(name)), (kernels, name[:90])):
            t = table.setdefault(key, [0.0, 0])
            t[0] += us
            t[1] += 1
    return {
        "total_us": round(sum(v[0] for v in fams.values()), 1),
        "families": {k: dict(us=round(v[0], 1), kernels=v[1])
                     for k, v in sorted(fams.items(), key=lambda kv: -kv[1][0])},
        "top": [dict(kernel=k, us=round(v[0], 1), calls=v[1])
                for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:8]],
    }


def layer_table(qmodel, x) -> list[dict]:
    """Every QConv2d on the input it sees in ``qmodel(x)``: its GPU time, and cuDNN bf16's for
    the same conv (+ bias) on the same shapes."""
    seen, hooks = [], []
    for name, mod in qmodel.named_modules():
        if isinstance(mod, QConv2d):
            def hook(m, args, kwargs, out, name=name):
                seen.append((name, m, args[0], kwargs.get("residual"), out))
            hooks.append(mod.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        qmodel(x)
    for h in hooks:
        h.remove()
    rows = []
    for name, mod, inp, res, out in seen:
        w = torch.randn(mod.weight.shape, device=inp.device, dtype=torch.bfloat16)
        w = w.contiguous(memory_format=CL)
        xb = torch.randn(inp.shape, device=inp.device, dtype=torch.bfloat16)
        xb = xb.contiguous(memory_format=CL)
        b = torch.zeros(w.shape[0], device=inp.device, dtype=torch.bfloat16)
        kw = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation,
                  groups=mod.groups)
        row = dict(layer=name, shape=list(inp.shape), weight=list(mod.weight.shape),
                   stride=mod.stride[0], groups=mod.groups, kernel=mod.triton_kernel,
                   x=str(inp.dtype).replace("torch.", ""),
                   out=str(out.dtype).replace("torch.", ""),
                   residual=str(res.dtype).replace("torch.", "") if res is not None else None,
                   act=mod.activation, post_act=mod.post_activation)
        with torch.no_grad():
            row["qfuse_us"] = gpu_us(lambda m=mod, i=inp, r=res: m(i, residual=r))
            row["cudnn_bf16_us"] = gpu_us(lambda xb=xb, w=w, b=b, kw=kw: F.conv2d(xb, w, b, **kw))
        rows.append(row)
    return rows


def build(name, tiny, device, hw):
    from tests import cnn_blocks

    if tiny:
        make = {"resnet": cnn_blocks.TinyResNet, "mobilenet": cnn_blocks.TinyMobileNet}
        model = make["mobilenet" if "mobilenet" in name else "resnet"]()
    else:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None)
    model = model.to(device)
    return cnn_blocks.reestimate_batchnorm(
        model, lambda: torch.randn(16, 3, hw, hw, device=device), steps=3)


def network(name, args, rows, profiles, deadline, save) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hw = 16 if args.tiny else 224
    torch.manual_seed(0)
    ref_model = build(name, args.tiny, device, hw)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    model = copy.deepcopy(ref_model).to(dt).to(memory_format=CL)
    impls = [("bf16_eager", "bf16", model)]
    if not args.no_compile:
        impls.append(("bf16_compile", "bf16", torch.compile(model, dynamic=True)))
    calib = [torch.randn(8, 3, hw, hw, device=device, dtype=dt) for _ in range(2)]
    for dtype in args.dtypes.split(","):
        t0 = time.time()
        prepared = qfuse.prepare(model, CONFIGS[dtype](), example_inputs=(calib[0],))
        with torch.no_grad():
            for c in calib:
                prepared(c)
        qmodel = qfuse.convert(prepared)
        rows_ = qfuse.summary(qmodel).rows
        fused = [r for r in rows_ if r["precision"] != "float"]
        float_out = [r["name"] for r in fused if r["output"] in ("float32", "bfloat16")]
        print(f"{name} {dtype}: converted in {time.time() - t0:.1f}s, {len(fused)} fused, "
              f"{len(float_out)} write float", flush=True)
        profiles[f"{name}/{dtype}/summary"] = dict(fused=len(fused), write_float=float_out,
                                                   float_layers=[r["name"] for r in rows_
                                                                 if r["precision"] == "float"])
        impls.append((f"qfuse_{dtype}", dtype, qmodel))
        if not args.no_compile and name in args.qfuse_compile.split(","):
            impls.append((f"qfuse_{dtype}_compile", dtype, torch.compile(qmodel, dynamic=True)))
    # The qfuse models' own compiles last: each takes a minute, and a --budget-s cut should
    # leave the uncompiled rows of every batch rather than the compiled ones of the first.
    late = [i for i in impls if i[0].startswith("qfuse") and i[0].endswith("_compile")]
    inputs = {}  # one input per batch size: every row of a batch sees the same images
    for b in H.ints(args.batches):
        x = torch.randn(b, 3, hw, hw, device=device, dtype=dt).contiguous(memory_format=CL)
        with torch.no_grad():
            inputs[b] = (x, ref_model(x.float()).double())
    for phase in ([i for i in impls if i not in late], late):
        for batch, (x, ref) in inputs.items() if phase else ():
            with torch.no_grad():
                for impl, dtype, m in phase:
                    rows.append(_row(name, batch, impl, dtype, m, x, ref, args, profiles,
                                     deadline))
                    save()
                if (phase is not late and batch == args.profile_batch and args.layers
                        and time.time() < deadline):
                    for impl, _, m in phase:
                        if impl == f"qfuse_{args.layers}":
                            profiles[f"{name}/{impl}/b{batch}/layers"] = layer_table(m, x)
    base = {r["batch"]: r.get("gpu_us") for r in rows
            if r.get("network") == name and r.get("impl") == "bf16_compile"}
    for r in rows:
        if r.get("network") == name and base.get(r["batch"]) and r.get("gpu_us"):
            r["x_bf16_compile"] = base[r["batch"]] / r["gpu_us"]


def _row(name, batch, impl, dtype, m, x, ref, args, profiles, deadline) -> dict:
    """One timed row, checked against the float32 model's output ``ref`` first."""
    if time.time() > deadline:
        return dict(network=name, batch=batch, impl=impl, error="time budget")
    row = dict(network=name, batch=batch, impl=impl, dtype=dtype)
    try:
        out = m(x)
        row["rel_err_vs_fp32"] = H.rel_err(out.float(), ref)
        row["top1_agree_fp32"] = (out.argmax(1) == ref.argmax(1)).float().mean().item()
        row["gpu_us"] = gpu_us(lambda: m(x))
        row["eager_us"] = eager_us(lambda: m(x))
        if batch == args.profile_batch:
            profiles[f"{name}/{impl}/b{batch}"] = breakdown(lambda: m(x))
    except Exception as exc:  # noqa: BLE001 — a failing row is a result
        row["error"] = H.error_text(exc)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def print_report(rows, profiles) -> None:
    print(f"{'network':>20} {'batch':>5} {'impl':>20} {'gpu_us':>9} {'eager_us':>9} "
          f"{'x_comp':>6} {'relerr':>7} {'top1':>5}")
    for r in rows:
        if "gpu_us" in r:
            print(f"{r['network']:>20} {r['batch']:5d} {r['impl']:>20} {r['gpu_us']:9.1f} "
                  f"{r['eager_us']:9.1f} {r.get('x_bf16_compile', 0):6.2f} "
                  f"{r['rel_err_vs_fp32']:7.3f} {r['top1_agree_fp32']:5.2f}")
        else:
            print(f"{r['network']:>20} {r.get('batch', '')!s:>5} {r.get('impl', '')!s:>20} "
                  f"{r.get('error', '')[:100]}")
    for key, prof in profiles.items():
        if key.endswith("/layers"):
            total_q = sum(r["qfuse_us"] for r in prof)
            total_c = sum(r["cudnn_bf16_us"] for r in prof)
            print(f"{key}: sum qfuse {total_q:.0f} us, cuDNN bf16 conv {total_c:.0f} us")
            for r in sorted(prof, key=lambda r: -r["qfuse_us"])[:12]:
                print(f"   {r['layer']:>28} {str(r['shape']):>22} {str(r['weight']):>20} "
                      f"s{r['stride']} {r['x']:>8}->{r['out']:>8} res={r['residual']} "
                      f"{r['qfuse_us']:7.1f} vs {r['cudnn_bf16_us']:7.1f}")
        elif "families" in prof:
            fams = ", ".join(f"{k} {v['us']:.0f}/{v['kernels']}" for k, v in
                             prof["families"].items())
            print(f"{key}: {prof['total_us']:.0f} us: {fams}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/conv_networks.json")
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--batches", default="32,128")
    p.add_argument("--dtypes", default="int8,fp8")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--layers", default="int8", help="per-layer table for this dtype ('' none)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--qfuse-compile", default=",".join(NETS),
                   help="networks whose qfuse models are also timed under torch.compile")
    p.add_argument("--tiny", action="store_true", help="tests/cnn_blocks models (CPU smoke)")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip rows after this long")
    a = p.parse_args(argv)
    deadline = time.time() + a.budget_s
    rows, profiles = [], {}

    def save() -> None:  # after every row: a run cut off by its time limit keeps what it measured
        H.write_results(a.out, rows, dict(profiles=profiles))

    for name in [v for v in a.nets.split(",") if v]:
        try:
            network(name, a, rows, profiles, deadline, save)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(network=name, error=H.error_text(exc)))
        save()
    print_report(rows, profiles)


if __name__ == "__main__":
    main()
