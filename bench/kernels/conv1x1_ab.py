"""A/B of resnet50's 1x1 stride-1 convs: the implicit GEMM, the TMA GEMM (``kernels.conv_tma``),
cuDNN bf16.

    QFUSE_COMMIT=$(git rev-parse HEAD) python -m bench.kernels.conv1x1_ab \\
        --out $OUT/conv1x1_ab.json                                  (GPU, ~3-6 min)
    python -m bench.kernels.conv1x1_ab --tiny                       (CPU smoke test)

The 33 1x1 stride-1 convs of torchvision resnet50 at batch 32, 224x224, channels-last (13
distinct shapes, counted; checked against torchvision's model where it is installed), each as
the converted network runs it: int8/fp8 input handed over by the previous layer, bias, ReLU,
int8/fp8 output; a bottleneck's conv3 adds the block's quantized input and applies ReLU after
(``post_act``), a downsample has no activation. Per shape and dtype:
- "mma": ``conv1x1_path="mma"``, ``conv._qconv_kernel`` with ``pick_config``'s schedule (the
  old path);
- "tma": ``conv1x1_path="tma"`` with ``conv_tma.pick_conv1x1_config``'s schedule (what
  ``qconv2d`` now runs), and "tma[i]": each of ``conv_tma.conv1x1_candidates`` (split-K set by
  the rule);
- "cudnn_bf16": ``F.conv2d`` alone in bf16, channels-last (no epilogue: what the conv costs).
Each qfuse row is checked first: int8 equal to "mma" bit for bit, fp8 outputs differing on < 5%
and by more than one e4m3 step on <= 0.1% (``stem_ab.agrees``). ``us``: GPU time from CUDA-graph
replays (``tuning.device_time_ms``); ``do_bench_us``: triton's do_bench median of eager calls
(``harness.median_us``: host launch cost included). The table's "net" rows sum ``us`` times the
number of such convs in the network.
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
from bench.kernels.stem_ab import agrees
from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv import tma as conv_tma
from qfuse.kernels.conv.call import ConvCall

FP8 = torch.float8_e4m3fn
QDTYPES = (("int8", torch.int8), ("fp8", FP8))
BATCH = 32
# (map size, c_in, c_out, role, count) of resnet50's 1x1 stride-1 convs; role: "relu" (conv1),
# "res" (conv3: + residual, then ReLU), "none" (layer1's downsample, the only stride-1 one).
RESNET50_1X1 = (
    (56, 64, 64, "relu", 1), (56, 64, 256, "res", 3), (56, 64, 256, "none", 1),
    (56, 256, 64, "relu", 2), (56, 256, 128, "relu", 1),
    (28, 128, 512, "res", 4), (28, 512, 128, "relu", 3), (28, 512, 256, "relu", 1),
    (14, 256, 1024, "res", 6), (14, 1024, 256, "relu", 5), (14, 1024, 512, "relu", 1),
    (7, 512, 2048, "res", 3), (7, 2048, 512, "relu", 2),
)
TINY = ((4, 32, 48, "relu", 1), (3, 64, 32, "res", 2))


def torchvision_shapes() -> list[tuple[int, int, int]] | None:
    """(map size, c_in, c_out) of every 1x1 stride-1 conv torchvision's resnet50 runs on a
    224x224 input, or None where torchvision is not installed."""
    try:
        import torchvision
    except ImportError:
        return None
    model = torchvision.models.resnet50(weights=None).eval()
    seen = []

    def hook(mod, inp, _out):
        if mod.kernel_size == (1, 1) and mod.stride == (1, 1):
            seen.append((inp[0].shape[-1], mod.in_channels, mod.out_channels))

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    return seen


def check_table() -> None:
    seen = torchvision_shapes()
    if seen is None:
        return
    table = sorted((hw, ci, co) for hw, ci, co, _, n in RESNET50_1X1 for _ in range(n))
    if sorted(seen) != table:
        raise SystemExit(f"RESNET50_1X1 does not match torchvision's resnet50: {sorted(seen)}")


def make_args(batch, hw, c_in, c_out, role, qdtype, device):
    g = torch.Generator().manual_seed(0)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    x = (torch.randn(batch, c_in, hw, hw, generator=g) * 2).clamp(-4, 4)
    xq = (x * (qmax / 4)).round().clamp(-qmax, qmax) if qdtype == torch.int8 else x * (qmax / 4)
    wf = torch.randn(c_out, c_in, 1, 1, generator=g) / c_in**0.5
    w_scale = wf.abs().amax(dim=(1, 2, 3)) / qmax
    wq = wf / w_scale.reshape(-1, 1, 1, 1)
    wq = wq.round().clamp(-127, 127) if qdtype == torch.int8 else wq
    bias = torch.randn(c_out, generator=g) * 0.1
    out_inv = torch.tensor(qmax / 3.0)
    res = None
    if role == "res":
        r = torch.randn(batch, c_out, hw, hw, generator=g).clamp(-3, 3) * out_inv
        res = r.round().clamp(-127, 127) if qdtype == torch.int8 else r
        res = res.to(qdtype).contiguous(memory_format=torch.channels_last).to(device)
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    args = H.call_args(ConvCall, dict(
        x=cl(xq.to(qdtype)).to(device), weight=conv.pack_weight(wq.to(qdtype)).to(device),
        scale=(w_scale * (4 / qmax)).to(device), bias=bias.to(device),
        x_inv_scale=torch.tensor(qmax / 4, device=device), x_zero_point=None, residual=res,
        out_inv_scale=out_inv.to(device), out_zero_point=None,
        act={"relu": "relu", "res": "none", "none": "none"}[role], out_dtype=qdtype,
        stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1,
        post_act="relu" if role == "res" else "none",
        residual_scale=torch.tensor(1 / float(out_inv), device=device) if res is not None
        else None,
        residual_zero_point=None,
    ))
    cudnn = dict(x=cl(x.to(device, torch.bfloat16)),
                 w=cl(wf.to(device, torch.bfloat16)), b=bias.to(device, torch.bfloat16))
    return args, cudnn


def run_case(hw, c_in, c_out, role, count, qname, qdtype, device, tiny) -> list[dict]:
    args, cu = make_args(2 if tiny else BATCH, hw, c_in, c_out, role, qdtype, device)
    M = args["x"].shape[0] * hw * hw
    base = dict(hw=hw, c_in=c_in, c_out=c_out, M=M, role=role, count=count, dtype=qname)
    old = conv.qconv2d(**args, conv1x1_path="mma")
    sms = conv_tma.sm_count(torch.device(device))
    cands = conv_tma.conv1x1_candidates(M, c_out, c_in, sms)
    if tiny:  # the interpreter: small tiles, split-K once
        cands = [conv_tma.Conv1x1Config(16, 32, 32, 4, 1, split_k=s) for s in (1, 2)]
    variants = [("mma", dict(conv1x1_path="mma"), None), ("tma", dict(conv1x1_path="tma"),
                                                           None)]
    variants += [(f"tma[{i}]", dict(conv1x1_path="tma", config=c), c)
                 for i, c in enumerate(cands)]
    flops = 2.0 * M * c_in * c_out
    rows = []
    for impl, kw, cfg in variants:
        row = dict(base, impl=impl)
        if impl == "tma":
            cfg = conv_tma.pick_conv1x1_config(M, c_out, c_in, sms, role == "res")
        if cfg is not None:
            row["config"] = dict(vars(cfg))
        fn = lambda kw=kw: conv.qconv2d(**args, **kw)  # noqa: E731
        try:
            ok, note = agrees(fn(), old, qdtype)
            row["check"] = note
            if not ok:
                row["error"] = f"wrong result: {note}"
            elif not tiny:
                row.update(timings(fn, flops))
        except Exception as exc:  # noqa: BLE001 — a schedule that fails to compile is a result
            row["error"] = H.error_text(exc)
        rows.append(row)
    if not tiny:
        ref = lambda: F.conv2d(cu["x"], cu["w"], cu["b"])  # noqa: E731
        rows.append(dict(base, impl="cudnn_bf16", **timings(ref, flops)))
    return rows


def timings(fn, flops: float) -> dict:
    from qfuse.kernels.tuning import device_time_ms

    us = device_time_ms(fn) * 1e3
    return dict(us=round(us, 2), do_bench_us=round(H.median_us(fn), 2),
                tops=round(flops / us / 1e6, 1))


def print_table(rows: list[dict]) -> None:
    print(f"{'hw':>3} {'cin':>5} {'cout':>5} {'M':>6} {'dtype':>5} {'impl':>10} {'us':>8} "
          f"{'TOPS':>6} {'x mma':>6} {'x cudnn':>7}  note")
    key = lambda q: (q["hw"], q["c_in"], q["c_out"], q["role"], q["dtype"])  # noqa: E731
    for r in rows:
        same = {q["impl"]: q.get("us") for q in rows if key(q) == key(r)}
        us = r.get("us")
        head = (f"{r['hw']:>3} {r['c_in']:>5} {r['c_out']:>5} {r['M']:>6} {r['dtype']:>5} "
                f"{r['impl']:>10}")
        if us is None:
            print(f"{head} {'-':>8}  {r.get('error') or r.get('check', '')}")
            continue
        x_old = same["mma"] / us if same.get("mma") else 0
        x_cu = same["cudnn_bf16"] / us if same.get("cudnn_bf16") else 0
        c = r.get("config")
        note = "" if not c else (f"{c['block_m']}x{c['block_n']}x{c['block_k']} "
                                 f"w{c['num_warps']} s{c['num_stages']} split{c['split_k']} "
                                 f"epi{c['epi_split']}")
        print(f"{head} {us:8.1f} {r['tops']:6.0f} {x_old:6.2f} {x_cu:7.2f}  {note}")
    for qname, _ in QDTYPES:  # the network's 1x1 convs: each shape times its count
        net = {}
        for r in rows:
            if r["dtype"] == qname and r["impl"] in ("mma", "tma", "cudnn_bf16") and r.get("us"):
                net[r["impl"]] = net.get(r["impl"], 0.0) + r["us"] * r["count"]
        if net:
            print(f"net {qname}: " + ", ".join(f"{k} {v:.0f} us" for k, v in net.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="conv1x1_ab.json", help="results JSON (written atomically)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes on the CPU under the Triton interpreter: checks, no timing")
    p.add_argument("--dtypes", default="int8,fp8", help="comma-separated subset of int8,fp8")
    a = p.parse_args()
    qdtypes = [(n, d) for n, d in QDTYPES if n in a.dtypes.split(",")]
    if not qdtypes or len(qdtypes) != len(a.dtypes.split(",")):
        p.error(f"--dtypes {a.dtypes!r}: use a comma-separated subset of int8,fp8")
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("conv1x1_ab.py times GPU kernels and needs CUDA (no CUDA device found);"
                         " run it on the device machine, or pass --tiny for a CPU smoke test.")
    device = "cpu" if a.tiny else "cuda"
    check_table()
    rows = []
    for hw, c_in, c_out, role, count in TINY if a.tiny else RESNET50_1X1:
        for qname, qdtype in qdtypes:
            rows += run_case(hw, c_in, c_out, role, count, qname, qdtype, device, a.tiny)
            H.write_results(a.out, rows, {"network": "torchvision resnet50, batch 32, 224x224,"
                                          " channels-last: 1x1 stride-1 convs"})
            print(f"done {hw}x{hw} {c_in}->{c_out} {qname}", flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
