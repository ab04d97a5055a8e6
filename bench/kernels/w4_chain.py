"""A TinyLlama decode step's 88 GEMMs with 4-bit weights, back to back in one CUDA graph, against
the same chain in int8 and in bf16 cuBLAS: the weight stream's bandwidth (issue #36).

    python -m bench.kernels.w4_chain --out $OUT/w4_chain.json          (GPU, ~2 min)
    python -m bench.kernels.w4_chain --sweep --out $OUT/w4_sweep.json  (+ other schedules)
    python -m bench.kernels.w4_chain --a8 --out $OUT/w4_chain.json     (+ W4A8, x per token)
    python -m bench.kernels.w4_chain --tiny --out /tmp/w4_chain.json   (CPU smoke test)
    python -m bench.kernels.w4_chain --ptxas                           (CPU: sm_90 registers)

The chain is ``decode_chain``'s (22 layers of ``decode_gemm_ab.SHAPES``' Q/K/V, o_proj + residual,
gate+up with SwiGLU, down + residual, each layer its own weights, so every GEMM streams from
HBM). Rows, at M = 1 and 16 tokens:

- ``qfuse_w4a16_g128``: 4-bit weights in groups of 128 with zero points (``QConfig.w4a16(128,
  symmetric=False)``'s layout), bf16 activations, the fused kernel (``kernels.gemm.w4``) with
  its default schedule (``pick_config``), one launch per GEMM, the epilogue in it (bias, SwiGLU,
  residual, bf16 out); with ``--sweep`` also other schedules (``sweep_templates``; at M = 1
  each role's 22 GEMMs alone under every schedule, then the chain with each role's fastest);
- ``qfuse_int8``: decode_chain's int8 chain (same code path, autotuned schedules, PDL on);
- ``bf16_cublas``: ``F.linear`` with SwiGLU between gate+up and down.

Correctness first: the 4-bit chain's first GEMM (layer 0's Q/K/V) against the CPU reference
(``ops.w4linear``) within bf16 output rounding, and each graph's output equals its eager chain.
Columns: us per step (``do_bench`` median of graph replays), TB/s of weight bytes, speedup vs
int8, and the bandwidth-bound floor: weight bytes / peak HBM bandwidth (4.8 TB/s on an H200,
3.35 TB/s on an H100 SXM; named in each row as ``floor_tb_s``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported: run the kernels in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

from bench.harness import cuda_kernels, environment, ints
from bench.kernels import decode_chain as dc
from bench.kernels import decode_gemm_ab as ab
from qfuse import int4
from qfuse.ops.w4linear import W4Call

GROUP = 128
TINY_GROUP = 32  # the tiny shapes' K is 64 and 88: several groups, a short last one
PEAK_TB_S = {"H200": 4.8, "H100": 3.35}


@dataclasses.dataclass
class Layer4:
    qkv: W4Call
    o: W4Call
    gate_up: W4Call
    down: W4Call


def _w4_call(call, group: int, act_bits: int = 16) -> W4Call:
    """The 4-bit twin of an int8 chain's ``GemmCall``: its weight (as bf16_layers scales it)
    rounded to 4 bits in asymmetric groups, its bias and activation, bf16 out; W4A8
    (``act_bits=8``): x quantized per token."""
    w = call.weight.float() * 0.01
    scale, zero = int4.group_qparams(w, group, symmetric=False)
    q = int4.quantize_groups(w, scale, zero, group)
    return W4Call(int4.pack(q), scale, zero, call.bias, w.shape[1], group, act=call.act,
                  act_bits=act_bits, out_dtype=torch.bfloat16)


def w4_layers(layers: list, group: int, act_bits: int = 16) -> list[Layer4]:
    return [Layer4(*(_w4_call(c, group, act_bits) for c in (L.qkv, L.o, L.gate_up, L.down)))
            for L in layers]


def w4_step(layers: list[Layer4], h: torch.Tensor, cfgs: dict | None = None) -> torch.Tensor:
    """The chain through the kernel's host function (its plain eager path, as ``w4linear``
    takes it); ``cfgs`` pins a schedule per role (else ``pick_config``)."""
    from qfuse.kernels.gemm.w4 import w4_gemm

    c = cfgs or {}

    def run(x, call: W4Call, role: str, residual=None):
        return w4_gemm(x, call.weight, call.scale, call.zero, call.bias, call.in_features,
                       call.group_size, call.act, call.act_bits, None, None, residual,
                       call.out_dtype, c.get(role))

    d = h.shape[1]
    for L in layers:
        qkv = run(h, L.qkv, "qkv")
        o = run(qkv[:, :d], L.o, "o_proj", h)
        gu = run(o, L.gate_up, "gate_up")
        h = run(gu, L.down, "down", o)
    return h


def role_configs(layers: list[Layer4], M: int, template, device) -> dict:
    """``template`` (a ``W4Config``) per role, with the split-K its shape gets."""
    from qfuse.kernels.gemm.w4 import with_split

    L = layers[0]
    return {r: with_split(template, M, c.weight.shape[0], c.in_features, c.group_size,
                          torch.device(device))
            for r, c in zip(dc.ROLES, (L.qkv, L.o, L.gate_up, L.down), strict=True)}


def sweep_templates(M: int) -> list:
    """Schedules to A/B against ``pick_config``'s (``--sweep``): the decode schedule's rows per
    program and warps, and the tiles' shapes."""
    from qfuse.kernels.gemm.w4 import W4Config

    bm = min(triton.next_power_of_2(M), 16)
    out = [W4Config(bm, bn, 128, 1, w, 1, True) for bn, w in
           ((8, 4), (16, 4), (32, 4), (32, 2), (64, 4))
           if bm == 1 or bm * bn <= 128]  # a step's products are [BM, BN, 128] (1 row: lanes)
    if M > 1:
        out += [W4Config(16 if M <= 16 else 32, bn, bk, 1, w, 3, False)
                for bn, bk, w in ((32, 128, 4), (64, 128, 4), (64, 128, 8), (64, 64, 4),
                                  (128, 128, 8))]
    return out


ATTRS = dict(zip(dc.ROLES, ("qkv", "o", "gate_up", "down"), strict=True))


def role_sweep(layers: list[Layer4], M: int, templates: list, device: str) -> tuple[list, dict]:
    """Each role's 22 GEMMs alone in one graph (the same input for all: each streams its own
    weights) under every template: rows, and the fastest template per role (with its split)."""
    from bench.harness import graphed
    from qfuse.kernels.gemm.w4 import w4_gemm

    rows, best = [], {}
    g = torch.Generator().manual_seed(3)
    for role, attr in ATTRS.items():
        c0 = getattr(layers[0], attr)
        x = (torch.randn(M, c0.in_features, generator=g) * 0.5).to(torch.bfloat16).to(device)
        n_out = c0.weight.shape[0] // (2 if c0.act == "swiglu" else 1)
        res = (torch.randn(M, n_out, generator=g).to(torch.bfloat16).to(device)
               if role in ("o_proj", "down") else None)
        nbytes = sum(t.numel() * t.element_size() for L in layers
                     for t in (getattr(L, attr).weight, getattr(L, attr).scale,
                               getattr(L, attr).zero))
        for template in templates:
            cfg = role_configs(layers, M, template, device)[role]

            def step(cfg=cfg, attr=attr, x=x, res=res):
                y = None
                for L in layers:
                    c = getattr(L, attr)
                    y = w4_gemm(x, c.weight, c.scale, c.zero, c.bias, c.in_features,
                                c.group_size, c.act, c.act_bits, None, None, res, c.out_dtype,
                                cfg)
                return y

            row = {"impl": f"role {role}", "M": M, "config": dataclasses.asdict(cfg),
                   "weight_bytes": nbytes, "sweep": True}
            try:
                replay = graphed(step)
                replay()
                us = triton.testing.do_bench(replay, warmup=5, rep=40, return_mode="median") * 1e3
                row.update(role_us=us, tb_s=nbytes / (us * 1e-6) / 1e12)
                del replay
                if role not in best or us < best[role][0]:
                    best[role] = (us, cfg)
            except Exception as exc:  # noqa: BLE001 — a failing variant is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows, {r: cfg for r, (_, cfg) in best.items()}


def w4_bytes(layers: list[Layer4]) -> int:
    """What a step streams: packed codes, scales and zero points."""
    return sum(t.numel() * t.element_size() for L in layers
               for c in (L.qkv, L.o, L.gate_up, L.down) for t in (c.weight, c.scale, c.zero))


def first_gemm_error(layers: list[Layer4], h0: torch.Tensor) -> float:
    """Layer 0's Q/K/V from the kernel against the CPU reference (relative, float64), both
    written in float32 (bf16 outputs would hide a small error in their rounding)."""
    from bench.harness import map_tensors
    from qfuse.kernels.gemm.w4 import w4_gemm
    from qfuse.ops.w4linear import _epilogue, gemm_reference

    c = layers[0].qkv
    got = w4_gemm(h0, c.weight, c.scale, c.zero, c.bias, c.in_features, c.group_size, c.act,
                  16, None, None, None, torch.float32).cpu().double()
    cpu = map_tensors(c, torch.Tensor.cpu)
    ref = _epilogue(gemm_reference(h0.cpu(), cpu), cpu, None, torch.float32).double()
    return ((got - ref).norm() / ref.norm()).item()


def peak_tb_s() -> tuple[str, float | None]:
    name = torch.cuda.get_device_name()
    for key, tb_s in PEAK_TB_S.items():
        if key in name:
            return key, tb_s
    return name, None


def timed_row(impl: str, M: int, step, nbytes: int, extra: dict) -> dict:
    """Graph the step, check the replay against an eager call without programmatic dependent
    launch (bit for bit: a missing wait would read a stale input), time it."""
    from bench.harness import graphed
    from qfuse.kernels import grid

    row = {"impl": impl, "M": M, "weight_bytes": nbytes, **extra}
    try:
        grid.PDL_ENABLED = False
        eager = step()
        grid.PDL_ENABLED = True
        replay = graphed(step)
        out = replay()
        torch.cuda.synchronize()
        # random weights: 22 layers of bf16 residual sums can overflow to inf/NaN, which the
        # comparison must treat as equal where both runs have them
        row["equals_eager"] = bool(((out == eager) | (out.isnan() & eager.isnan())).all())
        row["finite_share"] = out.isfinite().float().mean().item()
        if not row["equals_eager"]:
            diff = (out.float() - eager.float()).abs()
            finite = diff[diff.isfinite()]
            row["max_abs_diff"] = finite.max().item() if finite.numel() else None
            row["error"] = "graph output differs from the eager chain"
            return row
        us = triton.testing.do_bench(replay, warmup=5, rep=60, return_mode="median") * 1e3
        row.update(chain_us=us, tb_s=nbytes / (us * 1e-6) / 1e12)
        kernels = cuda_kernels(step)
        row["kernels_per_step"] = len(kernels)
        del replay
    except Exception as exc:  # noqa: BLE001 — a failing variant is a result
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def run(M: int, tiny: bool, device: str, sweep: bool = False, a8: bool = False
        ) -> list[dict]:
    from qfuse.kernels.gemm.w4 import pick_config, step_k

    d = 64 if tiny else 2048
    h0 = (torch.randn(M, d, generator=torch.Generator().manual_seed(0)) * 0.5).to(
        torch.bfloat16).to(device)
    int8 = dc.build_layers(M, "int8", device, tiny)
    layers = w4_layers(int8, TINY_GROUP if tiny else GROUP)
    rows = []
    err = first_gemm_error(layers, h0)
    # float32 sums in another order (per group, then scaled; bf16 x times the bf16 codes is
    # exact on the tensor cores): float32 rounding, ~1e-6
    ok = err < 1e-4
    picks = {}
    for r, c in zip(dc.ROLES, (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down),
                    strict=True):
        cfg = pick_config(M, c.weight.shape[0], c.in_features, c.group_size, 16,
                          torch.device(device))
        picks[r] = {**dataclasses.asdict(cfg), "step_k": step_k(cfg, c.in_features,
                                                                 c.group_size)}
    base = {"group": layers[0].qkv.group_size, "qkv_rel_err_vs_reference": err, "picks": picks}
    if device == "cpu":
        out = w4_step(layers, h0)
        rows.append({"impl": f"qfuse_w4a16_g{base['group']}", "M": M, **base, "reference_ok": ok,
                     "out_finite": bool(torch.isfinite(out.float()).all())})
        out8 = dc.qfuse_step(int8, h0)
        rows.append({"impl": "qfuse_int8", "M": M,
                     "out_finite": bool(torch.isfinite(out8.float()).all())})
        for r in rows:
            print(json.dumps(r), flush=True)
        return rows
    if not ok:
        rows.append({"impl": "qfuse_w4a16", "M": M, **base,
                     "error": f"first GEMM off the reference: relative error {err:.2e}"})
        print(json.dumps(rows[-1]), flush=True)
        return rows
    nbytes4 = w4_bytes(layers)
    rows.append(timed_row(f"qfuse_w4a16_g{GROUP}", M, lambda: w4_step(layers, h0), nbytes4,
                          base))
    if sweep and M == 1:  # per role, then the chain with each role's fastest schedule
        role_rows, tuned = role_sweep(layers, M, sweep_templates(M), device)
        rows += role_rows
        if len(tuned) == len(ATTRS):
            rows.append(timed_row(f"qfuse_w4a16_g{GROUP} tuned", M,
                                  lambda: w4_step(layers, h0, tuned), nbytes4,
                                  {"configs": {r: dataclasses.asdict(v)
                                               for r, v in tuned.items()}}))
    if a8:  # W4A8, x quantized per token (a quantize pass before each GEMM)
        layers8 = w4_layers(int8, GROUP, 8)
        rows.append(timed_row(f"qfuse_w4a8_g{GROUP}", M, lambda: w4_step(layers8, h0), nbytes4,
                              {}))
    for template in (sweep_templates(M) if sweep and M > 1 else ()):
        cfgs = role_configs(layers, M, template, device)
        name = ("decode" if template.decode else "tiles") + \
            f" {template.block_m}x{template.block_n}x{template.block_k} w{template.num_warps}"
        rows.append(timed_row(f"qfuse_w4a16_g{GROUP} {name}", M,
                              lambda c=cfgs: w4_step(layers, h0, c), nbytes4,
                              {"sweep": True, "configs": {r: dataclasses.asdict(v)
                                                          for r, v in cfgs.items()}}))
    # int8: decode_chain's chain and schedules (autotuned on its first call, PDL on)
    dc.qfuse_step(int8, h0)
    rows.append(timed_row("qfuse_int8", M, lambda: dc.qfuse_step(int8, h0),
                          dc.weight_bytes(int8), {"picks": dc.picks(int8, h0)}))
    bl = dc.bf16_layers(int8)
    rows.append(timed_row("bf16_cublas", M, lambda: dc.bf16_step(bl, h0),
                          sum(w.numel() * 2 for t in bl for w in t), {}))
    gpu, peak = peak_tb_s()
    int8_us = next((r.get("chain_us") for r in rows if r["impl"] == "qfuse_int8"), None)
    for r in rows:
        if peak is not None:
            r["floor_tb_s"], r["floor_gpu"] = peak, gpu
            r["floor_us"] = r["weight_bytes"] / (peak * 1e12) * 1e6
        if r.get("chain_us") and int8_us:
            r["x_vs_int8"] = int8_us / r["chain_us"]
    return rows


_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int8: "i8"}


def ptxas_report(ms: list[int], sms: int = 132) -> list[dict]:
    """``--ptxas``: compile every chain GEMM's launch (``pick_config`` for a GPU of ``sms``
    SMs, programmatic dependent launch on) for sm_90 on this machine, no GPU needed (Triton's
    compiler and its bundled ptxas), and report registers and spills per kernel: a schedule
    that spills or cannot be lowered shows here before any GPU time is spent."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qfuse.kernels.gemm.w4 import _w4_kernel, pick_config, w4_args

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    rows = []
    for M in ms:
        for name, K, N, act, _, _, residual in ab.SHAPES:
            if name == "k_or_v":
                continue
            g = torch.Generator().manual_seed(0)
            words = torch.randint(-2**31, 2**31 - 1, (N, K // 8), generator=g,
                                  dtype=torch.int32)
            scale, zero = torch.rand(N, K // GROUP) + 0.5, torch.zeros(N, K // GROUP,
                                                                      dtype=torch.int8)
            x = torch.randn(M, K).to(torch.bfloat16)
            n_out = N // 2 if act == "swiglu" else N
            res = torch.randn(M, n_out).to(torch.bfloat16) if residual else None
            cfg = pick_config(M, N, K, GROUP, 16, torch.device("cuda"), sms)
            _, _, args, options = w4_args(x, words, scale, zero, torch.zeros(N), K, GROUP, act,
                                          16, None, None, res, torch.bfloat16, cfg)
            args["PDL"] = cfg.decode
            sig, const, attrs = {}, {}, {}
            for i, arg in enumerate(_w4_kernel.arg_names):
                v = args[arg]
                if isinstance(v, torch.Tensor):
                    sig[arg] = "*" + _TYPES[v.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(v, bool) or arg.isupper():
                    sig[arg], const[arg] = "constexpr", v
                else:
                    sig[arg] = "i32"
                    if v % 16 == 0 and arg != "M":  # Triton specializes such ints
                        attrs[(i,)] = [["tt.divisibility", 16]]
            kernel = triton.compile(ASTSource(_w4_kernel, sig, const, attrs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=options["num_warps"],
                                                 num_stages=options["num_stages"]))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(kernel.asm["ptx"])
            info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                  capture_output=True, text=True).stderr
            os.unlink(f.name)
            regs = re.search(r"Used (\d+) registers", info)
            spill = re.search(r"(\d+) bytes spill stores", info)
            row = {"role": name, "M": M, "config": dataclasses.asdict(cfg),
                   "step_k": args["BLOCK_K"], "registers": int(regs[1]) if regs else None,
                   "spill_bytes": int(spill[1]) if spill else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="2 small layers on the CPU, no timing")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--no-precompile", action="store_true",
                    help="let the int8 chain's autotune compile as it goes")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other 4-bit schedules (sweep_templates) in the chain")
    ap.add_argument("--a8", action="store_true", help="also time the W4A8 (per-token) chain")
    ap.add_argument("--ptxas", action="store_true",
                    help="no GPU: compile the chain's kernels for sm_90, report registers/spills")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny else "cuda"
    ms = ints(a.ms)
    if a.ptxas:
        rows = ptxas_report(ms)
        bad = [r for r in rows if r["registers"] is None or r["spill_bytes"]]
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"environment": environment(), "ptxas": rows}, f, indent=1)
        sys.exit(1 if bad else 0)
    if a.tiny:
        from qfuse.ops.backend import use_backend

        ctx = use_backend("triton")
    else:
        import contextlib

        ctx = contextlib.nullcontext()
        if not a.no_precompile:  # the int8 chain's autotune candidates, compiled in parallel
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            cases = [ab.Case(s, M, "int8") for s in ab.SHAPES if s[0] != "k_or_v" for M in ms]
            ab.precompile([(c, cfg) for c in cases for cfg in ab.qfuse_configs(c, sms)],
                          min(12, os.cpu_count() or 1))
    rows = []
    with ctx:
        for M in ms:
            rows += run(M, a.tiny, device, a.sweep, a.a8)
            if device == "cuda":
                torch.cuda.empty_cache()
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
        os.replace(tmp, a.out)
    print(f"{'impl':40} {'M':>3} {'us/step':>9} {'TB/s':>6} {'x int8':>7} {'floor us':>9}")
    for r in rows:
        print(f"{r['impl']:40} {r['M']:>3} {r.get('chain_us', float('nan')):9.1f} "
              f"{r.get('tb_s', float('nan')):6.2f} {r.get('x_vs_int8', float('nan')):7.2f} "
              f"{r.get('floor_us', float('nan')):9.1f} {r.get('error', '')}")
    bad = [r for r in rows if (r.get("error") and not r.get("sweep"))
           or r.get("reference_ok") is False or r.get("out_finite") is False]
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
