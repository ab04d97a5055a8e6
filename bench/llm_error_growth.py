"""Why the random TinyLlama-shape model's quantized logits are far from float: per decoder layer,
the error a layer adds on its own (float input into the quantized layer) against the error the
residual stream carries after it (quantized all the way), for int8 static and int8 weight-only.

    PYTHONPATH=. python bench/llm_error_growth.py --out bench/results/llm_error_growth_cpu.json

Runs on the CPU (the reference kernels, fp32 model) in a few minutes; ``--layers`` and
``--init`` (LlamaConfig.initializer_range, HF's default 0.02) change the model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_llm import SHAPES  # noqa: E402

import qfuse  # noqa: E402


def build(layers: int, init: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPES["tinyllama"], "num_hidden_layers": layers},
                         initializer_range=init, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def quantized(model, config, calib):
    prepared = qfuse.prepare(model, config, (), example_kwargs={"input_ids": calib[0]})
    with torch.no_grad():
        for ids in calib:
            prepared(input_ids=ids)
    return qfuse.convert(prepared, output="model")


def layer_io(model, ids):
    """Each decoder layer's (args, kwargs) and output hidden state, and the logits."""
    record = []
    hooks = []
    for layer in model.model.layers:
        def pre(mod, args, kwargs):
            record.append({"args": args, "kwargs": kwargs})

        def post(mod, args, kwargs, out):
            record[-1]["out"] = out[0] if isinstance(out, tuple) else out

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return record, logits


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(model, qmodel, ids) -> dict:
    ref, ref_logits = layer_io(model, ids)
    got, logits = layer_io(qmodel, ids)
    rows = []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        with torch.no_grad():  # layer i quantized, fed the float model's input to layer i
            alone = qmodel.model.layers[i](*r["args"], **r["kwargs"])
        alone = alone[0] if isinstance(alone, tuple) else alone
        update = r["out"] - r["args"][0]  # what the float layer adds to the residual stream
        rows.append(dict(layer=i, alone_rel_err=rel(alone, r["out"]),
                         alone_update_rel_err=rel(alone - r["args"][0], update),
                         stream_rel_err=rel(g["out"], r["out"]),
                         update_over_stream=(update.norm() / r["args"][0].norm()).item()))
    agree = (logits[:, -1].argmax(-1) == ref_logits[:, -1].argmax(-1)).double().mean().item()
    last = ref_logits[0, -1].double()
    top2 = last.topk(2).values
    return dict(layers=rows, logits_rel_err=rel(logits, ref_logits), argmax_agree=agree,
                logit_std=last.std().item(), top1_top2_gap=(top2[0] - top2[1]).item())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--inits", default="0.02,0.005")
    ap.add_argument("--configs", default="int8_static,int8_weight_only")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default="bench/results/llm_error_growth_cpu.json")
    args = ap.parse_args(argv)
    harness.DEVICE = "cpu"
    g = torch.Generator().manual_seed(10)
    vocab = SHAPES["tinyllama"]["vocab_size"]
    calib = [torch.randint(0, vocab, (1, 64), generator=g) for _ in range(3)]
    ids = torch.randint(0, vocab, (2, args.seq), generator=g)
    results = []
    for init in (float(v) for v in args.inits.split(",")):
        model = build(args.layers, init)
        for name in args.configs.split(","):
            t0 = time.time()
            qmodel = quantized(model, getattr(qfuse.QConfig, name)(), calib)
            res = dict(init=init, config=name, **measure(model, qmodel, ids),
                       wall_s=round(time.time() - t0, 1))
            results.append(res)
            print(f"init {init} {name}: logits rel err {res['logits_rel_err']:.3f}, argmax "
                  f"agree {res['argmax_agree']:.2f}, gap {res['top1_top2_gap']:.3f} "
                  f"({res['wall_s']} s)", flush=True)
            for r in res["layers"]:
                print("   " + " ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True)
            harness.write_results(args.out, results, extra=dict(layers=args.layers,
                                                                seq=args.seq))
            del qmodel


if __name__ == "__main__":
    main()
