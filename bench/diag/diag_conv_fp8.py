"""fp8 implicit-GEMM conv: Triton's default sm_90 accumulation against promoted fp32 accumulation.

On an H100 (torch 2.11 / triton 3.6) ``test_gpu_real_shapes`` failed for fp8 on every
implicit-GEMM shape, only near zero (worst 4.1e-3 absolute in y at K=576). Triton lets an fp8
``tl.dot`` accumulate in place at the tensor core's precision on sm_90
(``max_num_imprecise_acc`` = 2**30); ``ConvConfig.fp8_promote`` = P adds a float32 partial every
P K-elements instead. For each shape and mode this measures, against the exact reference
(``ops.reference.qconv2d``, on the CPU):
- fp8 output (the failing test's first check: float x quantized in the prologue or a separate
  pass, ReLU, out_inv_scale 100): worst |error| in y, values outside the old test bound (two
  e4m3 steps) and outside ``qfuse.testing``'s bound for the mode, and the median GPU time;
- float32 output (no output rounding): the relative Frobenius error of y, and the measured
  ``eps`` = max |y - y_ref| / (magnitude sum * scale), to set against the bound's 2**-10
  (tensor core) or K * 2**-24 (float32).
Also checks that int8 is still bit-exact on one shape. Shapes and data are
``tests/kernels/test_conv.py``'s (``make_case``).

    python -m bench.diag.diag_conv_fp8 --out $OUT/conv_fp8.json     # GPU, < 90 s
    python -m bench.diag.diag_conv_fp8 --tiny                        # CPU, interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:  # before triton is imported: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from bench import harness as H
from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv.call import ConvCall, output_size
from qfuse.ops import reference
from qfuse.testing import (
    FP8,
    accumulation_eps,
    conv_magnitude,
    fp8_accumulation,
    output_excess,
)
from tests.kernels.test_conv import make_case

# name -> make_case keywords; the first five are test_gpu_real_shapes' implicit-GEMM ones
SHAPES = {
    "n8 c64-64 56 3x3 (K=576)": dict(n=8, c_in=64, c_out=64, hw=(56, 56)),
    "n4 c256-64 28 1x1 (K=256)": dict(n=4, c_in=256, c_out=64, hw=(28, 28), k=1, padding=0),
    "n4 c128-128 28 3x3 s2 (K=1152)": dict(n=4, c_in=128, c_out=128, hw=(28, 28), stride=2),
    "n2 c3-64 64 7x7 s2 stem (K=147)": dict(n=2, c_in=3, c_out=64, hw=(64, 64), k=7, stride=2,
                                            padding=3),
    "n1 c512-512 7 3x3 (K=4608)": dict(n=1, c_in=512, c_out=512, hw=(7, 7)),
    "r50 n32 c256-64 56 1x1": dict(n=32, c_in=256, c_out=64, hw=(56, 56), k=1, padding=0),
    "r50 n32 c1024-256 14 1x1": dict(n=32, c_in=1024, c_out=256, hw=(14, 14), k=1, padding=0),
    "r50 n32 c128-128 28 3x3": dict(n=32, c_in=128, c_out=128, hw=(28, 28)),
}
TINY = {
    "tiny 3x3 (K=72)": dict(n=1, c_in=8, c_out=16, hw=(6, 5)),
    "tiny 1x1 (K=40)": dict(n=1, c_in=40, c_out=16, hw=(4, 4), k=1, padding=0),
}
# Promotion intervals in K-elements (0: Triton's default). Each is capped at the schedule's
# block_k (a tl.dot always promotes at its end), so equal effective values run once: 0, every
# tile (64 or 128) and every wgmma (32). Each is a compile (~2-3 s), hence no more; the float32
# output (accumulation error alone) is measured for the first two only.
PROMOTES = (0, 128, 32)


def case(device: str, **spec) -> dict:
    """``make_case``'s conv as ``qconv2d`` takes it: ``x``, ``call``, ``residual``."""
    return H.call_args(ConvCall, make_case(device, **spec))


def _block_k(args: dict) -> int:
    """The schedule's block_k for this conv (as ``qconv2d`` picks it)."""
    x, call = args["x"], args["call"]
    n, _, h, wd = x.shape
    o, cg_in, kh, kw = call.weight.shape
    oh, ow = output_size(h, wd, (kh, kw), call.stride, call.padding, call.dilation)
    k_total = kh * kw * cg_in
    if call.groups == 1 and kh * kw > 1 and cg_in < 16:  # the stem's patch buffer
        cg_in = k_total = -(-k_total // 16) * 16
    return conv.pick_config(n * oh * ow, cg_in, o, k_total, True).block_k


def _bench(fn) -> float | None:
    if not torch.cuda.is_available():
        return None
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def measure(name: str, spec: dict, device: str, time_it: bool) -> list[dict]:
    rows = []
    q_args = case(device, qdtype=FP8, out_dtype=FP8, act="relu", **spec)
    f_args = case(device, qdtype=FP8, out_dtype=torch.float32, act="none", **spec)
    cpu_q, cpu_f = H.to_device(q_args, "cpu"), H.to_device(f_args, "cpu")
    ref_q = reference.qconv2d(**cpu_q).double()
    ref_f = reference.qconv2d(**cpu_f).double()
    call = cpu_q["call"]
    xq = reference._quantize_input(cpu_q["x"], call.x_inv_scale, None, FP8)
    w = call.weight
    mag = conv_magnitude(xq, w, call.stride, call.padding, call.dilation,
                         call.groups) * call.scale.double().abs().reshape(1, -1, 1, 1)
    K = w.shape[1] * w.shape[2] * w.shape[3]
    inv = call.out_inv_scale.item()
    bk = _block_k(cpu_q)
    done = set()
    for promote in PROMOTES:
        eff = min(promote, bk)
        if eff in done:
            continue
        done.add(eff)
        out_q = conv.qconv2d(**q_args, fp8_promote=eff)
        a = out_q.cpu().double()
        err_y = (a - ref_q).abs() / inv
        old_step = (torch.maximum(a.abs(), ref_q.abs()) / 8 + 2.0**-9) * (2 if a.is_cuda else 1)
        mode = fp8_accumulation(device, eff)
        new = output_excess(out_q.cpu(), ref_q.to(FP8), accumulation_eps(mode, K) * mag, inv)
        diff_f = None
        if eff in (0, bk):
            diff_f = (conv.qconv2d(**f_args, fp8_promote=eff).cpu().double() - ref_f).abs()
        rows.append(dict(
            shape=name, K=K, block_k=bk, promote=eff, mode=mode.value, outputs=a.numel(),
            worst_abs_err_y=err_y.max().item(),
            worst_at_ref=(ref_q.flatten()[err_y.argmax()] / inv).item(),
            outside_old_bound=int(((a - ref_q).abs() > old_step).sum()),
            outside_new_bound=int((new > 1).sum()), new_bound_use=new.max().item(),
            differ_fraction=(a != ref_q).float().mean().item(),
            rel_frobenius_f32=(diff_f.norm() / ref_f.norm()).item() if diff_f is not None
            else None,
            measured_eps_log2=torch.log2((diff_f / mag.clamp_min(1e-30)).max()).item()
            if diff_f is not None else None,
            us=_bench(lambda p=eff: conv.qconv2d(**q_args, fp8_promote=p)) if time_it else None,
        ))
    return rows


def int8_bit_exact(device: str, spec: dict) -> bool:
    args = case(device, qdtype=torch.int8, out_dtype=torch.int8, act="relu", **spec)
    return bool(torch.equal(conv.qconv2d(**args).cpu(),
                            reference.qconv2d(**H.to_device(args, "cpu"))))


def _fmt(v: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(v, spec) if v is not None else "-".rjust(width)


def table(rows: list[dict]) -> str:
    head = (f"{'shape':34} {'P':>4} {'mode':15} {'worst|dy|':>9} {'at ref':>7} {'old>':>6} "
            f"{'new>':>5} {'use':>5} {'relF32':>8} {'eps':>6} {'us':>7}")
    lines = [head]
    for r in rows:
        us, rel, eps = (_fmt(r["us"], "7.1f"), _fmt(r["rel_frobenius_f32"], "8.1e"),
                        _fmt(r["measured_eps_log2"], "6.1f"))
        lines.append(
            f"{r['shape']:34} {r['promote']:>4} {r['mode']:15} {r['worst_abs_err_y']:9.2e} "
            f"{r['worst_at_ref']:7.3f} {r['outside_old_bound']:6d} {r['outside_new_bound']:5d} "
            f"{r['new_bound_use']:5.2f} {rel} {eps} {us}")
    lines.append("P: promotion interval (0 = Triton default); old>: outside two e4m3 steps; "
                 "new>: outside qfuse.testing's bound (use: worst fraction of it); eps: log2 "
                 "max |dy| / (magnitude * scale), float32 output")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="two small shapes, CPU interpreter")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds; shapes not started by then are skipped (listed in the JSON)")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    device = "cpu" if opts.tiny else "cuda"
    shapes = TINY if opts.tiny else SHAPES
    rows, skipped = [], []
    int8_ok = int8_bit_exact(device, next(iter(shapes.values())))
    print(f"int8 bit-exact ({next(iter(shapes))}): {int8_ok}", flush=True)
    for name, spec in shapes.items():
        if time.perf_counter() - t0 > opts.budget:
            skipped.append(name)
            continue
        rows += measure(name, spec, device, time_it=not opts.tiny)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    info = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__, triton=__import__("triton").__version__,
        int8_bit_exact=int8_ok, skipped=skipped, seconds=time.perf_counter() - t0, rows=rows,
    )
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(info, f, indent=1)
    print(f"{info['device']}, torch {info['torch']}, triton {info['triton']}; "
          f"{info['seconds']:.0f} s; skipped: {skipped or 'none'}; int8 bit-exact: {int8_ok}")
    print(table(rows))


if __name__ == "__main__":
    main()
