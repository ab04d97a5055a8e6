"""Time ``_qlinear_kernel`` over a grid of block configs per shape: the data behind tuning.py.

    PYTHONPATH=. python bench/sweep_qgemm.py --out sweep.json

Each config is checked against the first config's output (int8 out: identical) before timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import harness as H  # noqa: E402

from qfuse.kernels import qgemm  # noqa: E402

SHAPES = ((16, 4096, 14336), (128, 4096, 14336), (2048, 4096, 14336), (16384, 4096, 14336))


def configs(M):
    bms = (16, 32, 64) if M <= 64 else (64, 128)
    for bm, bn, bk, st, wp in itertools.product(bms, (64, 128, 256), (64, 128, 256), (3, 4, 5),
                                                (4, 8)):
        if bm * bk + bk * bn > 64 * 1024 // 2 or (bn == 256 and bk == 256):
            continue
        if wp == 8 and bm * bn < 128 * 128:
            continue
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=wp, num_stages=st)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="sweep.json")
    p.add_argument("--budget_s", type=float, default=150)
    a = p.parse_args()
    t0 = time.time()
    results = []
    original = qgemm._pick_config
    for M, K, N in SHAPES:
        x = torch.randint(-128, 128, (M, K), device="cuda", dtype=torch.int8)
        w = torch.randint(-127, 128, (N, K), device="cuda", dtype=torch.int8)
        scale = torch.rand(N, device="cuda") * 1e-4
        one = torch.ones((), device="cuda")
        run = lambda: qgemm.qlinear(x, w, scale, None, None, None, None, None, one, None,  # noqa
                                    "none", torch.int8)
        ref = run()
        best = None
        for cfg in configs(M):
            if time.time() - t0 > a.budget_s:
                break
            qgemm._pick_config = lambda *_, c=cfg: c
            try:
                out = run()
                ok = torch.equal(out, ref)
                us = H.median_us(run) if ok else None
            except Exception as exc:  # noqa: BLE001 — out of shared memory etc.
                ok, us = False, str(exc).splitlines()[0][:80]
            finally:
                qgemm._pick_config = original
            results.append(dict(M=M, K=K, N=N, cfg=cfg, ok=ok, us=us))
            if ok and (best is None or us < best[0]):
                best = (us, cfg)
        default_us = H.median_us(run)
        if best:
            tops = 2 * M * N * K / best[0] / 1e6
            print(f"M={M} K={K} N={N} default {default_us:.1f} us, best {best[0]:.1f} us "
                  f"({tops:.0f} TOPS) {best[1]}", flush=True)
    with open(a.out, "w") as f:
        json.dump({**H.environment(), "triton_version": triton.__version__, "rows": results}, f)


if __name__ == "__main__":
    main()
