"""The digits recipe's models on the GPU: is quantized at least as fast as fp32 (issue #11)?

    python -m bench.models.digits_speed --out $OUT/digits.json

``recipes.ptq_digits``' CNN+MLP (trained, or loaded from the recipe's cache), calibrated and
converted as the recipe does, one forward of a batch of 256 test images:
  fp32 and bf16 (what a user runs instead), qfuse int8 and fp8 static,
each timed three ways: ``eager_us`` (do_bench of one eager call, what the recipe prints),
``graph_us`` (GPU time of CUDA-graph replays, no host launch cost) and ``compile_us``
(``torch.compile`` of the model, replayed in a graph). Correctness first: top-1 on the test split.
"""

from __future__ import annotations

import argparse
import copy

import torch
from qfuse.calibration.digits import batches, load_digits_splits
from qfuse.recipes.ptq_digits import accuracy, load_or_train

import qfuse
from bench import harness as H


def _time(model, x) -> dict:
    if not x.is_cuda:  # CPU smoke test: the script runs end to end; no timing
        with torch.no_grad():
            model(x)
            torch.compile(model, fullgraph=True)(x)
        return {}
    from triton.testing import do_bench

    from qfuse.kernels.tuning import device_time_ms

    with torch.no_grad():
        row = dict(eager_us=do_bench(lambda: model(x), warmup=25, rep=100,
                                     return_mode="median") * 1e3,
                   graph_us=device_time_ms(lambda: model(x)) * 1e3)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        try:
            row["compile_us"] = device_time_ms(lambda: compiled(x)) * 1e3
        except Exception as exc:  # noqa: BLE001 — a failing row is a result
            row["compile_error"] = H.error_text(exc)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/digits.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    splits = load_digits_splits(seed=0)
    model = load_or_train(splits, 40, 0, True)
    calib_x, _ = splits.calibration
    test_x, test_y = splits.test
    x = test_x[:256].to(dev)
    models = {}
    for name, config in (("int8", qfuse.QConfig.int8_static()),
                         ("fp8", qfuse.QConfig.fp8_static())):
        prepared = qfuse.prepare(model.cpu(), config, example_inputs=(calib_x[:8],))
        with torch.no_grad():
            for xb in batches(calib_x, 64):
                prepared(xb)
        models[name] = qfuse.convert(prepared).to(dev)
    model = model.to(dev)
    models = {"fp32": (model, x), "bf16": (copy.deepcopy(model).to(torch.bfloat16),
                                           x.to(torch.bfloat16)),
              **{k: (m, x) for k, m in models.items()}}
    rows = []
    for name, (m, inp) in models.items():
        acc = accuracy(m, test_x, test_y, dev) if name != "bf16" else None
        row = dict(model=name, batch=len(x), top1=acc, **_time(m, inp))
        rows.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    fp32 = rows[0]
    for r in rows:
        for key in ("eager_us", "graph_us", "compile_us"):
            if key in r and key in fp32:
                r["x_fp32_" + key.split("_")[0]] = fp32[key] / r[key]
    H.write_results(a.out, rows)
    if dev.type == "cpu":
        return
    print(f"{'model':>6} {'top1':>6} {'eager_us':>9} {'graph_us':>9} {'compile_us':>10} "
          f"{'x_fp32 eager/graph/compile':>28}")
    for r in rows:
        ratios = "/".join(f"{r.get('x_fp32_' + k, 0):.2f}" for k in ("eager", "graph", "compile"))
        print(f"{r['model']:>6} {r['top1'] or 0:6.2f} {r['eager_us']:9.1f} {r['graph_us']:9.1f} "
              f"{r.get('compile_us', 0):10.1f} {ratios:>28}")


if __name__ == "__main__":
    main()
