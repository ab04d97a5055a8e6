"""Where ``generate()``'s per-token time goes: GPU kernels against the wall, and Dynamo's graph
breaks and recompiles, for bf16 and qfuse on the TinyLlama-shape Llama of ``bench_llm.py``.

    python -m bench.diag.diag_generate --out $OUT/diag_generate.json
    python -m bench.diag.diag_generate --tiny          # CPU smoke test
    python -m bench.diag.diag_generate \
        --impls bf16,bf16:decodegraphs,qfuse_int8,qfuse_int8:trees

For each impl: ``generate(cache_implementation="static")`` greedy as a user calls it (its first
calls compile), then one call of ``--tokens`` new tokens under torch.profiler: wall time, summed
GPU kernel time and kernel count per new token, the top kernels, and Dynamo's counters (graph
breaks, unique graphs) collected over the whole run; ``decode_call_host_us``, the host time of
the compiled decode call alone (``timed_decode_calls``). A per-token wall well above the GPU time
is host time (Python, launches) that no kernel can win back; ``cudagraph_skips`` counts the
compiled graphs Inductor ran without CUDA graphs; ``host`` is Python's own profile per token
(own and cumulative times), ``wall_us_per_token_no_guards`` the wall with Dynamo's guards
skipped (their cost is the difference).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from bench import harness
from bench.models.bench_llm import (
    PROMPT,
    build,
    decode_graph_stats,
    decode_machinery,
    qfuse_model,
)


def host_profile(fn, tokens: int, top: int = 25) -> dict:
    """Python's own profile of ``fn`` in microseconds per new token: the functions with the
    most time of their own (with calls per token), and with the most time including what they
    call (where the host's time goes)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [(tt, ct, nc, f"{Path(fname).name}:{line}({func})")
            for (fname, line, func), (_, nc, tt, ct, _) in stats.items()]
    per = lambda t: round(t / tokens * 1e6, 1)  # noqa: E731
    return dict(
        own=[(per(tt), round(nc / tokens, 1), name)
             for tt, _, nc, name in sorted(rows, reverse=True)[:top]],
        cumulative=[(per(ct), round(nc / tokens, 1), name)
                    for _, ct, nc, name in sorted(rows, key=lambda r: -r[1])[:top]])


def timed_decode_calls(model, gen, tokens: int) -> dict:
    """Host time of the compiled decode call itself (transformers' torch.compile wrapper or
    qfuse's DecodeGraphs), from the call to its return: for both that is after the graph's
    launch, before the GPU is done. The median over one ``generate(3 * tokens)``'s steady calls
    (each call after a generate's first two: those compile, warm up or capture), so that the
    VM's drift between calls does not move it; the rest of a token's wall is transformers' loop
    and the GPU."""
    real = model.get_compiled_call
    spent: list[float] = []

    def patched(config):
        fn = real(config)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent.append(time.perf_counter() - t0)
            return out

        return timed

    model.get_compiled_call = patched
    try:
        gen(tokens)
        spent.clear()
        gen(3 * tokens)
    finally:
        del model.get_compiled_call
    steady = sorted(spent[2:])
    if not steady:  # transformers compiles the decode step on a GPU only
        return dict(decode_call_host_us=None, decode_calls=0)
    return dict(decode_call_host_us=steady[len(steady) // 2] * 1e6,
                decode_call_host_us_p90=steady[int(len(steady) * 0.9)] * 1e6,
                decode_calls=len(steady))


def profile_generate(model, ids, tokens: int, device: str) -> dict:
    from torch._dynamo.utils import counters

    def gen(n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, cache_implementation="static")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def per_token() -> float:
        """Wall microseconds per new token: the difference of a long and a short call."""
        walls = {}
        for n in (tokens, 3 * tokens):
            sync()
            t0 = time.perf_counter()
            gen(n)
            sync()
            walls[n] = time.perf_counter() - t0
        return (walls[3 * tokens] - walls[tokens]) / (2 * tokens) * 1e6

    torch._dynamo.reset()
    counters.clear()
    gen(3 * tokens)  # compiles
    gen(tokens)
    row = dict(wall_us_per_token=per_token(),
               graph_breaks=sum(counters["graph_break"].values()),
               unique_graphs=counters["stats"].get("unique_graphs", 0),
               break_reasons=sorted(counters["graph_break"])[:8],
               cudagraph_skips=counters["inductor"].get("cudagraph_skips", 0))
    # The same with Dynamo's guards not evaluated (unsafe in general, exact here: nothing
    # changes between calls): the difference is the guards' host cost per token.
    try:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            row["wall_us_per_token_no_guards"] = per_token()
    except Exception as exc:  # noqa: BLE001 — older torch: no such stance
        row["wall_us_per_token_no_guards"] = harness.error_text(exc)
    row.update(timed_decode_calls(model, gen, tokens))
    row["host"] = host_profile(lambda: gen(tokens), tokens)
    if device == "cuda":
        kernels = harness.cuda_kernels(lambda: gen(tokens))
        total = sum(us for _, us in kernels)
        by_name: dict[str, float] = {}
        for name, us in kernels:
            by_name[name[:80]] = by_name.get(name[:80], 0.0) + us
        row.update(gpu_us_per_token=total / tokens, kernels_per_token=len(kernels) / tokens,
                   top=sorted(((round(us / tokens, 1), n) for n, us in by_name.items()),
                              reverse=True)[:10])
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", default="bf16,qfuse_int8",
                   help="impl[:trees|:decodegraphs], comma-separated: the decode machinery "
                        "(default: as a user has the model; bench_llm.decode_machinery)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    shape, device = ("tiny", "cpu") if args.tiny else ("tinyllama", "cuda")
    harness.DEVICE = device
    bf16 = build(shape, device, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, bf16.config.vocab_size, (1, PROMPT[shape]), generator=g).to(device)
    # Every model is built before any generate(): transformers caches its compiled forward on
    # the model (``_compiled_call``), and a model converted from bf16 after bf16's generate
    # carried bf16's compiled call with it (the first H200 run timed bf16 twice).
    runs = [(name, *(name.split(":") + ["generate"])[:2]) for name in args.impls.split(",")]
    models = {impl: bf16 if impl == "bf16" else qfuse_model(bf16, impl, bf16.config.vocab_size,
                                                            device)
              for impl in dict.fromkeys(base for _, base, _ in runs)}
    rows = []
    for impl, base, machinery in runs:
        mode = "generate" if machinery == "generate" else f"generate-{machinery}"
        try:
            with decode_machinery(models[base], mode):
                row = dict(impl=impl, **profile_generate(models[base], ids, args.tokens, device),
                           **decode_graph_stats(models[base]))
        except Exception as exc:  # noqa: BLE001 — a failing row is a result
            row = dict(impl=impl, error=harness.error_text(exc))
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("top", "host")}, flush=True)
        for view, top in row.get("host", {}).items():
            for us, calls, name in top:
                print(f"   {view:10s} {us:8.1f} us/token {calls:7.1f} calls/token  {name}",
                      flush=True)
    if args.out:
        harness.write_results(args.out, rows)


if __name__ == "__main__":
    main()
