"""Where a converted encoder's host time goes, eager and compiled (no CUDA graph).

    python -m bench.diag.diag_host [--model bert-base] [--batch 32]

``bench_models.py`` says a qfuse model is launch-bound in eager and in compile mode (its GPU
time is a third of its wall time); this prints, for qfuse int8 and fp8 and for bf16, the wall
time per forward, the launch plans' state (``summary``'s backend column: a layer that fell back
to Triton's plain launch says why) and the cProfile functions with the most own time over 20
forwards, so a fix targets a measured cost.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats

import torch

import qfuse
from bench import harness
from bench.models import bench_models as B


def profile(name: str, fn, calls: int = 20, top: int = 22) -> None:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n--- {name}: {harness.wall_us(fn):.0f} us per forward (wall); cProfile top {top} "
          f"by own time over {calls} forwards", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def first_sync(name: str, fn) -> None:
    """Where ``fn`` first makes the host wait for the GPU (``set_sync_debug_mode("error")``):
    a sync inside a forward serializes host and GPU time, under ``do_bench`` too."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        print(f"{name}: no synchronizing call in a forward", flush=True)
    except RuntimeError as exc:
        import traceback

        frames = traceback.format_tb(exc.__traceback__)[-6:]
        print(f"{name}: synchronizes: {exc}\n" + "".join(frames), flush=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="int8 only")
    a = ap.parse_args()
    bf16 = B.build(a.model, torch.bfloat16, "cuda")
    inp = B.tokens(a.batch, "cuda")
    first_sync("bf16 eager", lambda: bf16(**inp))
    profile("bf16 eager", lambda: bf16(**inp))
    for name, cfg in (("int8", qfuse.QConfig(symmetric=False)),
                      ("fp8", qfuse.QConfig.fp8_static())):
        q = B.qfuse_model(bf16, cfg, "cuda")
        q(**inp)
        nodes = collections.Counter(n.op for n in q.graph.nodes)
        print(f"\n=== qfuse {name}: graph nodes {dict(nodes)}")
        kernels = collections.Counter(r["kernel"] for r in qfuse.summary(q).rows)
        print("kernels (summary):", dict(kernels))
        first_sync(f"qfuse {name} eager", lambda q=q: q(**inp))
        profile(f"qfuse {name} eager", lambda q=q: q(**inp))
        torch._dynamo.reset()
        c = torch.compile(q)
        first_sync(f"qfuse {name} compile", lambda c=c: c(**inp))
        profile(f"qfuse {name} compile", lambda c=c: c(**inp))
        if a.quick:
            break


if __name__ == "__main__":
    main()
