"""A TinyLlama decode step's quantized GEMMs alone, back to back in one CUDA graph: the weight
stream's bandwidth, with and without programmatic dependent launch (PDL).

    python -m bench.kernels.decode_chain --out $OUT/decode_chain.json     (GPU, ~1 min)
    python -m bench.kernels.decode_chain --tiny                            (CPU smoke test)

22 layers of TinyLlama-1.1B's four GEMMs with the epilogues a converted decoder layer gives them
(``decode_gemm_ab.SHAPES``): Q/K/V merged from the bf16 hidden state; o_proj from the attention
output's place (here Q/K/V's first 2048 columns) plus the residual; gate+up merged with SwiGLU,
handing int8/fp8 to down; down plus the residual, whose output feeds the next layer. Each layer
has its own copy of the weights (0.97 GB int8 in all, ~20x the L2), so every GEMM streams from
HBM as in a real step; nothing else runs between them, so the chain's time is the GEMMs' own,
launch gaps included. Rows:

- qfuse int8 / fp8 with the schedules autotune picks, ``pdl`` off and on (``grid.pdl``;
  only the decode family launches that way);
- bf16 cuBLAS (``F.linear``, SwiGLU between gate+up and down as the model runs it).

Correctness first: each chain's output equals the same chain launched eagerly without PDL (int8
bit for bit: a missing wait would read a stale input), and the first layer's Q/K/V matches the
CPU reference. Timing: median of ``do_bench`` over graph replays (one replay = one step's GEMMs).
TB/s counts the weight bytes once per replay.
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
import torch.nn.functional as F
import triton

from bench.harness import environment, graphed, ints, map_tensors, to_device
from bench.kernels import decode_gemm_ab as ab
from qfuse.kernels.gemm.call import GemmCall

LAYERS = 22
TINY_LAYERS = 2


@dataclasses.dataclass
class Layer:
    """One decoder layer's four GEMM calls, each with its own weights."""

    qkv: GemmCall
    o: GemmCall
    gate_up: GemmCall
    down: GemmCall


def _layer_args(case_shapes: dict, M: int, qname: str, device: str) -> dict:
    return {name: ab.make_args(ab.Case(shape, M, qname), device) for name, shape in
            case_shapes.items()}


def build_layers(M: int, qname: str, device: str, tiny: bool) -> list[Layer]:
    shapes = {s[0]: s for s in ab.SHAPES}
    if tiny:  # small shapes that chain: hidden 64, Q/K/V 80, intermediate 88
        shapes = {
            "qkv": ("qkv", 64, 80, "none", False, False, False),
            "o_proj": ("o_proj", 64, 64, "none", False, False, True),
            "gate_up": ("gate_up", 64, 176, "swiglu", False, True, False),
            "down": ("down", 88, 64, "none", True, False, True),
        }
    base = _layer_args({k: shapes[k] for k in ("qkv", "o_proj", "gate_up", "down")}, M, qname,
                       device)
    layers = []
    for _ in range(TINY_LAYERS if tiny else LAYERS):
        own = {name: map_tensors(a["call"], torch.Tensor.clone) for name, a in base.items()}
        layers.append(Layer(own["qkv"], own["o_proj"], own["gate_up"], own["down"]))
    return layers


ROLES = ("qkv", "o_proj", "gate_up", "down")


def qfuse_step(layers: list[Layer], h: torch.Tensor, cfgs: dict | None = None) -> torch.Tensor:
    """The chain; ``cfgs`` pins a schedule per role (else ``tuning`` picks)."""
    from qfuse.kernels.gemm import dispatch as qgemm

    c = cfgs or {}
    d = h.shape[1]
    for L in layers:
        qkv = qgemm.qlinear(h, L.qkv, config=c.get("qkv"))
        o = qgemm.qlinear(qkv[:, :d], L.o, residual=h, config=c.get("o_proj"))
        gu = qgemm.qlinear(o, L.gate_up, config=c.get("gate_up"))
        h = qgemm.qlinear(gu, L.down, residual=o, config=c.get("down"))
    return h


def role_cases(M: int, qname: str) -> dict:
    shapes = {s[0]: s for s in ab.SHAPES}
    return {r: ab.Case(shapes[r], M, qname) for r in ROLES}


def chain_us(layers, h0, cfgs, rep: int = 30) -> float:
    replay = graphed(lambda: qfuse_step(layers, h0, cfgs))
    us = triton.testing.do_bench(replay, warmup=3, rep=rep, return_mode="median") * 1e3
    del replay
    return us


def tune_in_chain(layers, h0, M: int, qname: str, start: dict) -> tuple[dict, list]:
    """Coordinate descent over the roles: each role's candidates (every schedule autotune
    offers, ``decode_gemm_ab.qfuse_configs``) timed inside the whole graphed chain with the
    other roles at their best so far. A GEMM's best schedule alone (cold L2, its own launch)
    need not be its best between its neighbours, once programmatic dependent launch overlaps
    them."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = dict(start)
    best_us = chain_us(layers, h0, best)
    log = [{"start": {r: ab.cfg_name(c) for r, c in best.items()}, "us": best_us}]
    for role in ("gate_up", "down", "qkv", "o_proj"):
        for cfg in ab.qfuse_configs(role_cases(M, qname)[role], sms):
            if cfg == best[role]:
                continue
            trial = best | {role: cfg}
            try:
                us = chain_us(layers, h0, trial)
            except Exception as exc:  # noqa: BLE001 — a schedule that fails here is skipped
                log.append({"role": role, "cfg": ab.cfg_name(cfg), "error": str(exc)[:200]})
                continue
            log.append({"role": role, "cfg": ab.cfg_name(cfg), "us": us})
            if us < best_us * 0.995:
                best, best_us = trial, us
        print(f"  {qname} {role}: {ab.cfg_name(best[role])} -> {best_us:.1f} us", flush=True)
    return best, log


def table_rows(best: dict, M: int, qname: str) -> dict:
    """``tuned_configs`` rows (keyed as ``tuning.cache_key`` keys them) for ``best``."""
    import dataclasses as dc

    from qfuse.kernels.common import LIGHT_ACTIVATIONS
    from qfuse.kernels.tuning import cache_key

    gpu = torch.cuda.get_device_name()
    rows = {}
    for role, case in role_cases(M, qname).items():
        _, K, N, act, x_q, *_ = case.shape
        key = cache_key(gpu, case.kind, M, N, K, "" if act in LIGHT_ACTIVATIONS else act)
        rows[key] = dc.astuple(best[role])
    return rows


def bf16_layers(layers: list[Layer]) -> list[tuple]:
    return [tuple(a.weight.float().to(torch.bfloat16) * 0.01
                  for a in (L.qkv, L.o, L.gate_up, L.down)) for L in layers]


def bf16_step(weights: list[tuple], h: torch.Tensor) -> torch.Tensor:
    d = h.shape[1]
    for wqkv, wo, wgu, wd in weights:
        qkv = F.linear(h, wqkv)
        o = F.linear(qkv[:, :d], wo) + h
        g, u = F.linear(o, wgu).chunk(2, dim=-1)
        h = F.linear(F.silu(g) * u, wd) + o
    return h


def weight_bytes(layers: list[Layer]) -> int:
    return sum(a.weight.numel() * a.weight.element_size()
               for L in layers for a in (L.qkv, L.o, L.gate_up, L.down))


def cfg_of(layers: list[Layer], h: torch.Tensor, role: str):
    """The schedule ``tuning`` picked for ``role`` (its in-memory choice, after a first call)."""
    from qfuse.kernels.gemm import dispatch as qgemm

    call = {"qkv": layers[0].qkv, "o_proj": layers[0].o, "gate_up": layers[0].gate_up,
            "down": layers[0].down}[role]
    K = call.weight.shape[1]
    x = h if role != "down" else torch.zeros(h.shape[0], K, device=h.device,
                                             dtype=layers[0].gate_up.out_dtype)
    return qgemm.schedule(x, call)


def picks(layers: list[Layer], h: torch.Tensor) -> dict:
    return {r: ab.cfg_name(cfg_of(layers, h, r)) for r in ROLES}


def role_kernel_us(layers, h0, cfgs=None) -> dict:
    """Mean GPU time of each role's kernels in one eager chain (torch.profiler; launch order is
    qkv, o_proj, gate_up, down per layer; a schedule with a quantize pass adds its kernel)."""
    qfuse_step(layers, h0, cfgs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        qfuse_step(layers, h0, cfgs)
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and "qlinear" in e.name),
                key=lambda e: e.time_range.start)
    if len(ev) != 4 * len(layers):
        return {"kernels": len(ev)}
    out = {}
    for i, r in enumerate(ROLES):
        times = [e.time_range.elapsed_us() for e in ev[i::4]]
        out[r] = sum(times) / len(times)
    return out


def run(M: int, tiny: bool, device: str, tune: bool = False) -> list[dict]:
    from qfuse.kernels import grid

    rows = []
    d = 64 if tiny else 2048
    h0 = (torch.randn(M, d, generator=torch.Generator().manual_seed(0)) * 0.5).to(
        torch.bfloat16).to(device)
    for qname in ("int8", "fp8"):
        layers = build_layers(M, qname, device, tiny)
        nbytes = weight_bytes(layers)
        grid.PDL_ENABLED = True
        qfuse_step(layers, h0)  # autotunes (the precompiled candidates are PDL launches)
        grid.PDL_ENABLED = False
        eager = qfuse_step(layers, h0)
        if device == "cpu":
            rows.append({"impl": f"qfuse_{qname}", "M": M, "out_finite":
                         bool(torch.isfinite(eager.float()).all())})
            continue
        # the first layer's Q/K/V against the CPU reference
        from qfuse.ops import reference

        ref = reference.qlinear(**to_device({"x": h0, "call": layers[0].qkv}, "cpu"))
        from qfuse.kernels.gemm import dispatch as qgemm

        got = qgemm.qlinear(h0, layers[0].qkv).cpu()
        qkv_err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        for pdl in (False, True):
            grid.PDL_ENABLED = pdl
            row = {"impl": f"qfuse_{qname}", "pdl": pdl, "M": M, "weight_bytes": nbytes,
                   "qkv_rel_err_vs_reference": qkv_err, "picks": picks(layers, h0)}
            try:
                replay = graphed(lambda ls=layers: qfuse_step(ls, h0))
                out = replay()
                torch.cuda.synchronize()
                same = (torch.equal(out, eager) if qname == "int8"
                        else (out.float() - eager.float()).abs().max().item() == 0.0)
                row["equals_eager_no_pdl"] = same
                if not same:
                    row["error"] = "graph output differs from the eager chain without PDL"
                else:
                    us = triton.testing.do_bench(replay, warmup=5, rep=60,
                                                    return_mode="median") * 1e3
                    row.update(chain_us=us, tb_s=nbytes / (us * 1e-6) / 1e12)
            except Exception as exc:  # noqa: BLE001 — a failing variant is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["kernels_us"] = role_kernel_us(layers, h0)
            rows.append(row)
            print(json.dumps(row), flush=True)
        grid.PDL_ENABLED = True
        if tune:
            start = {r: cfg_of(layers, h0, r) for r in ROLES}
            best, log = tune_in_chain(layers, h0, M, qname, start)
            replay = graphed(lambda ls=layers, c=best: qfuse_step(ls, h0, c))
            out = replay()
            torch.cuda.synchronize()
            same = (torch.equal(out, eager) if qname == "int8"
                    else (out.float() - eager.float()).abs().max().item() == 0.0)
            us = triton.testing.do_bench(replay, warmup=5, rep=60, return_mode="median") * 1e3
            del replay
            row = {"impl": f"qfuse_{qname}", "pdl": True, "M": M, "tuned_in_chain": True,
                   "weight_bytes": nbytes, "chain_us": us, "tb_s": nbytes / (us * 1e-6) / 1e12,
                   "equals_eager_no_pdl": same if qname == "int8" else None,
                   "picks": {r: ab.cfg_name(c) for r, c in best.items()},
                   "table_rows": table_rows(best, M, qname), "tuning_log": log,
                   "kernels_us": role_kernel_us(layers, h0, best)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tuning_log"}), flush=True)
        del layers
        torch.cuda.empty_cache()
    if device != "cpu":
        bl = bf16_layers(build_layers(M, "int8", device, tiny))
        nbytes = sum(w.numel() * 2 for t in bl for w in t)
        replay = graphed(lambda: bf16_step(bl, h0))
        us = triton.testing.do_bench(replay, warmup=5, rep=60, return_mode="median") * 1e3
        rows.append({"impl": "bf16_cublas", "M": M, "weight_bytes": nbytes, "chain_us": us,
                     "tb_s": nbytes / (us * 1e-6) / 1e12})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--tune", action="store_true",
                    help="also pick each role's schedule by timing it inside the chain")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    device = "cpu" if a.tiny else "cuda"
    ms = ints(a.ms)
    if not a.tiny:  # autotune compiles every candidate: fill Triton's disk cache in parallel
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cases = [ab.Case(s, M, q) for s in ab.SHAPES if s[0] != "k_or_v" for M in ms
                 for q in ("int8", "fp8")]
        ab.precompile([(c, cfg) for c in cases for cfg in ab.qfuse_configs(c, sms)],
                      min(12, os.cpu_count() or 1))
    rows = []
    for M in ms:
        rows += run(M, a.tiny, device, a.tune)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
        os.replace(tmp, a.out)
    print(f"{'impl':14} {'M':>3} {'pdl':>5} {'us':>8} {'TB/s':>6}")
    for r in rows:
        print(f"{r['impl']:14} {r['M']:>3} {str(r.get('pdl', '-')):>5} "
              f"{r.get('chain_us', float('nan')):8.1f} {r.get('tb_s', float('nan')):6.2f} "
              f"{r.get('error', '')}")


if __name__ == "__main__":
    main()
