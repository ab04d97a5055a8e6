"""A/B of the ResNet stem conv (7x7 stride 2 pad 3, 3 -> 64 channels, ReLU, int8/fp8 out).

    python -m bench.kernels.stem_ab --out $OUT/stem_ab.json      (GPU, 2-4 min)
    python -m bench.kernels.stem_ab --tiny                            (CPU smoke test)

Per batch (32, 1), input layout (channels-last as ``conv_networks.py`` feeds the models, and
NCHW) and output dtype, from a bf16 input:
- "old": the patch-buffer path (``stem_path="im2col"``: the input quantized in its own pass,
  ``_im2col_kernel`` writing the [N*112*112, 160] buffer, the 1x1 ``_qconv_kernel`` over it),
  what qfuse ran before the stem kernel;
- "flat": the implicit GEMM's flat-K loop (``stem_path="flat"``), the other existing path;
- "stem[i]": each schedule of ``stem.stem_candidates`` (index 0 is what ``qconv2d`` picks);
- "cudnn_bf16": ``F.conv2d`` in bf16 channels-last with its bias, then ReLU (what bf16 users run).
Each qfuse variant is checked before it is timed: int8 against "old" bit for bit; fp8 outputs
differing on < 5%, by more than one quantization step on <= 0.1%. Times are GPU time from
CUDA-graph replays (``tuning.device_time_ms``: 8 calls a graph, median of 9 replays, L2 not
flushed); each qfuse row also carries its per-kernel split (``kernels``, torch.profiler, no
graph); ``GB/s`` counts the bf16 input read once and the output written once, the least any
stem must move. cuDNN gets the channels-last input in both rows (its fast layout).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported: run the kernels in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from bench import harness as H
from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv import stem
from qfuse.kernels.conv.call import ConvCall

FP8 = torch.float8_e4m3fn
QDTYPES = (("int8", torch.int8), ("fp8", FP8))


def make_args(batch: int, hw: int, c_out: int, qdtype, channels_last: bool, device: str):
    """The stem as a converted ResNet runs it: bf16 input, static scales, bias, ReLU, quantized
    output handed to the max-pool."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, hw, hw, generator=g).to(device, torch.bfloat16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    wf = torch.randn(c_out, 3, 7, 7, generator=g) * 0.05
    bias = torch.randn(c_out, generator=g) * 0.1
    w_scale = wf.abs().amax(dim=(1, 2, 3)) / (127.0 if qdtype == torch.int8 else 448.0)
    w = (wf / w_scale.reshape(-1, 1, 1, 1)).round().clamp(-127, 127) if qdtype == torch.int8 \
        else (wf / w_scale.reshape(-1, 1, 1, 1))
    x_inv = 127.5 / 4.0 if qdtype == torch.int8 else 448.0 / 4.0  # |x| < 4 for randn
    args = H.call_args(ConvCall, dict(
        x=x, weight=conv.pack_weight(w.to(qdtype)).to(device),
        scale=(w_scale / x_inv).to(device), bias=bias.to(device),
        x_inv_scale=torch.tensor(x_inv, device=device), x_zero_point=None, residual=None,
        out_inv_scale=torch.tensor(127.0 / 3.0 if qdtype == torch.int8 else 448.0 / 3.0,
                                   device=device),
        out_zero_point=None, act="relu", out_dtype=qdtype, stride=[2, 2], padding=[3, 3],
        dilation=[1, 1], groups=1,
    ))
    cudnn = dict(x=x.contiguous(memory_format=torch.channels_last),  # cuDNN's fast layout
                 w=wf.to(device, torch.bfloat16).contiguous(memory_format=torch.channels_last),
                 b=bias.to(device, torch.bfloat16))
    return args, cudnn


def agrees(out: torch.Tensor, old: torch.Tensor, qdtype) -> tuple[bool, str]:
    if qdtype == torch.int8:
        diff = (out.float() - old.float()).abs().max().item()
        return diff == 0, f"max |int8 diff| {diff:g}"
    # fp8 outputs of two summation orders (and wgmma's reduced-precision accumulation over
    # different K chunks): a differing output sits on a rounding boundary
    o, r = out.float(), old.float()
    step = r.abs().clamp(min=2.0**-6) * 2.0**-3  # at least one e4m3 step (3 mantissa bits)
    far = ((o - r).abs() > step * 1.01).float().mean().item()
    differ = (o != r).float().mean().item()
    return far <= 1e-3 and differ < 0.05, f"differ {differ:.4f}, > 1 step {far:.5f}"


def timed(fn, tiny: bool) -> float | None:
    if tiny:
        return None
    from qfuse.kernels.tuning import device_time_ms

    return device_time_ms(fn) * 1e3


def kernel_split(fn, calls: int = 4) -> dict[str, float]:
    """GPU us per call of each kernel ``fn`` launches (torch.profiler, no graph)."""
    split: dict[str, float] = {}
    for name, us in H.cuda_kernels(fn, calls=calls):
        split[name[:40]] = split.get(name[:40], 0.0) + us / calls
    return {k: round(v, 1) for k, v in split.items()}


def run_case(batch, hw, c_out, qname, qdtype, channels_last, device, tiny) -> list[dict]:
    args, cu = make_args(batch, hw, c_out, qdtype, channels_last, device)
    layout = "nhwc" if channels_last else "nchw"
    base = dict(batch=batch, hw=hw, c_out=c_out, layout=layout, dtype=qname)
    oh = (hw + 6 - 7) // 2 + 1
    moved = args["x"].numel() * 2 + batch * oh * oh * c_out  # bytes: bf16 in, 1-byte out
    old_fn = lambda: conv.qconv2d(**args, stem_path="im2col")  # noqa: E731
    old = old_fn()
    variants = [("old", dict(stem_path="im2col"), None), ("flat", dict(stem_path="flat"), None)]
    candidates = stem.stem_candidates(c_out)
    if tiny:  # the interpreter: its smallest tiles, each knob once
        candidates = [stem.StemConfig(32, 32, 32, 4, 1, kmajor, pq)
                      for kmajor in (True, False) for pq in (False, True)]
    variants += [(f"stem[{i}]", dict(config=c), c) for i, c in enumerate(candidates)]
    rows = []
    for impl, kw, cfg in variants:
        row = dict(base, impl=impl)
        if cfg is not None:
            row["config"] = {k: v for k, v in vars(cfg).items()}
        fn = lambda kw=kw: conv.qconv2d(**args, **kw)  # noqa: E731
        try:
            ok, note = agrees(fn(), old, qdtype)
            row["check"] = note
            if not ok:
                row["error"] = f"wrong result: {note}"
            else:
                row["us"] = timed(fn, tiny)
                if not tiny:
                    row["kernels"] = kernel_split(fn)
        except Exception as exc:  # noqa: BLE001 — a schedule that fails to compile is a result
            row["error"] = H.error_text(exc)
        rows.append(row)
    ref = lambda: F.relu(F.conv2d(cu["x"], cu["w"], cu["b"], 2, 3))  # noqa: E731
    if not tiny:
        rows.append(dict(base, impl="cudnn_bf16", us=timed(ref, tiny)))
    for r in rows:
        if r.get("us"):
            r["GB/s"] = round(moved / r["us"] / 1e3, 1)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'layout':>6} {'dtype':>5} {'impl':>10} {'us':>8} {'GB/s':>7} "
          f"{'x old':>6} {'x cudnn':>7}  note")
    for r in rows:
        group = lambda q: (q["batch"], q["layout"], q["dtype"])  # noqa: E731
        same = {q["impl"]: q.get("us") for q in rows if group(q) == group(r)}
        us = r.get("us")
        if us is None:
            print(f"{r['batch']:>5} {r['layout']:>6} {r['dtype']:>5} {r['impl']:>10} "
                  f"{'-':>8}  {r.get('error') or r.get('check', '')}")
            continue
        x_old = same.get("old") / us if same.get("old") else 0
        x_cu = same.get("cudnn_bf16") / us if same.get("cudnn_bf16") else 0
        cfg = r.get("config")
        note = "" if not cfg else (f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} "
                                   f"w{cfg['num_warps']} s{cfg['num_stages']} "
                                   f"{'kmajor' if cfg['kmajor'] else 'a-op'} "
                                   f"{'prequant' if cfg['prequantize'] else 'in-reg'}")
        print(f"{r['batch']:>5} {r['layout']:>6} {r['dtype']:>5} {r['impl']:>10} {us:8.1f} "
              f"{r['GB/s']:7.0f} {x_old:6.2f} {x_cu:7.2f}  {note}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="stem_ab.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, no timing")
    p.add_argument("--batches", default="32,1")
    a = p.parse_args()
    device = "cpu" if a.tiny else "cuda"
    hw, c_out = (20, 16) if a.tiny else (224, 64)
    batches = [2] if a.tiny else H.ints(a.batches)
    rows = []
    for batch in batches:
        for channels_last in (True, False):
            for qname, qdtype in QDTYPES:
                rows += run_case(batch, hw, c_out, qname, qdtype, channels_last, device, a.tiny)
                H.write_results(a.out, rows, {"shape": "Nx3x224x224 7x7 s2 p3 -> 64, relu"})
                print(f"done batch {batch} {'nhwc' if channels_last else 'nchw'} {qname}",
                      flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
