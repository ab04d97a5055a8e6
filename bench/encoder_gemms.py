"""The GEMMs of BERT-base and MiniLM one by one: every qfuse schedule candidate against cuBLAS bf16.

    PYTHONPATH=. python bench/encoder_gemms.py [--out bench/results/encoder_gemms_h200.json]

Whole-model profiles (bench_models.py) give the quantized GEMMs' total; this says, per shape,
which schedule wins and by how much against ``F.linear`` in bf16, so the candidate list in
``kernels/tuning.py`` is set from measurements. Inputs are int8/fp8 (handed over, as inside a
fused model), outputs bf16; ``do_bench`` medians.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import harness as H  # noqa: E402

from qfuse.kernels import qgemm, tuning  # noqa: E402

SHAPES = {  # (K, N): q+k+v merged, attention out, FFN up, FFN down
    "minilm": [(384, 1152), (384, 384), (384, 1536), (1536, 384)],
    "bert-base": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", default="4096,16384")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for model, shapes in SHAPES.items():
        for M in map(int, a.M.split(",")):
            for K, N in shapes:
                xb = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
                bf16 = H.median_us(lambda xb=xb, wb=wb: F.linear(xb, wb))
                for qd, name in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
                    x = (xb * 20).clamp(-127, 127).to(qd)
                    w = (wb * 300).clamp(-127, 127).to(qd)
                    scale = torch.full((N,), 1e-3, device="cuda")
                    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                    report = []
                    run = lambda cfg, x=x, w=w, s=scale, o=out: qgemm.launch(  # noqa: E731
                        x, w, s, None, None, None, None, None, None, None, None, "gelu", o, cfg,
                        True)
                    cands = tuning.candidates(M, N, K, f"{name}-xq", 132)
                    tuning.autotune(run, cands, report)
                    timed = [(us * 1e3, c) for c, us in report if isinstance(us, float)]
                    best_us, best = min(timed, key=lambda t: t[0])
                    rows.append(dict(model=model, M=M, K=K, N=N, dtype=name, bf16_us=bf16,
                                     best_us=best_us, best=str(best),
                                     all=[(round(u, 2), str(c)) for u, c in timed]))
                    print(f"{model:9s} M{M:<6d} K{K:<5d} N{N:<5d} {name:4s} bf16 {bf16:7.1f} us"
                          f"  qfuse best {best_us:7.1f} us ({bf16 / best_us:4.2f}x)  "
                          f"{best.block_m}x{best.block_n}x{best.block_k} w{best.num_warps} "
                          f"s{best.num_stages}", flush=True)
    if a.out:
        H.write_results(a.out, rows)


if __name__ == "__main__":
    main()
