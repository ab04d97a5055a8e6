"""Why the random TinyLlama-shape model's quantized logits are far from float: per decoder layer,
the error a layer adds on its own (float input into the quantized layer) against the error the
residual stream carries after it (quantized all the way), for int8 static and int8 weight-only.

    python -m bench.diag.llm_error_growth --out $OUT/llm_error_growth.json
    python -m bench.diag.llm_error_growth --layers 2 --configs int8_static \
        --out $OUT/llm_error_growth_gemms.json   # layer 0's GEMMs, in seconds

Runs on the CPU (the reference kernels, fp32 model), ~10 minutes for 22 layers; ``--layers``
and ``--inits`` (LlamaConfig.initializer_range, HF's default 0.02) change the model. Per
config it also gives layer 0's GEMMs one by one (``gemm_errors``): input and weight
quantization error and the input's peak-to-RMS ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

import qfuse
from bench import harness
from bench.models.bench_llm import SHAPES


def build(layers: int, init: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPES["tinyllama"], "num_hidden_layers": layers},
                         initializer_range=init, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


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


def gemm_errors(model, qmodel, ids, layer: int = 0) -> list[dict]:
    """Per GEMM of decoder layer ``layer``: the relative error of its input after int8
    quantization with the converted layer's static scale (down: the scale gate/up's epilogue
    quantizes the SwiGLU product with) and per token (dynamic), of its per-channel int8
    weight, and the input's peak-to-RMS ratio (what a per-tensor scale has to span)."""
    inputs = {}
    prefix = f"model.layers.{layer}."
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: inputs.setdefault(n, a[0]))
             for n, m in model.named_modules() if n.startswith(prefix)
             and isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    q = dict(qmodel.named_modules())
    rows = []
    for name, x in inputs.items():
        short = name[len(prefix):]
        gate_up = q.get(name.rsplit(".", 1)[0] + ".gate_up")
        if short.endswith(("gate_proj", "up_proj")):
            mod, rows_of = gate_up, slice(0 if short.endswith("gate_proj") else 1, None, 2)
            inv = mod.x_inv_scale
        elif short.endswith("down_proj"):
            mod, rows_of = q[name.rsplit(".", 1)[0] + ".down"], slice(None)
            inv = gate_up.out_inv_scale
        else:
            mod, rows_of, inv = q[name], slice(None), q[name].x_inv_scale
        x = x.double().flatten(0, -2)
        static = (x * inv).round().clamp(-128, 127) / inv
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        dynamic = (x * 127 / amax).round() * amax / 127
        w = model.get_submodule(name).weight.double()
        wq = mod.qweight if hasattr(mod, "qweight") else mod.weight
        w_deq = wq[rows_of].double() * mod.weight_scale[rows_of].double()[:, None]
        rows.append(dict(gemm=short, x_static_rel_err=rel(static, x),
                         x_dynamic_rel_err=rel(dynamic, x), w_rel_err=rel(w_deq, w),
                         x_peak_over_rms=(x.abs().max() / x.pow(2).mean().sqrt()).item()))
    return rows


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
            qmodel = harness.calibrated(model, getattr(qfuse.QConfig, name)(),
                                         [{"input_ids": ids} for ids in calib], output="model")
            res = dict(init=init, config=name, **measure(model, qmodel, ids),
                       gemms=gemm_errors(model, qmodel, ids), wall_s=round(time.time() - t0, 1))
            results.append(res)
            print(f"init {init} {name}: logits rel err {res['logits_rel_err']:.3f}, argmax "
                  f"agree {res['argmax_agree']:.2f}, gap {res['top1_top2_gap']:.3f} "
                  f"({res['wall_s']} s)", flush=True)
            for r in res["layers"] + res["gemms"]:
                print("   " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in r.items()), flush=True)
            harness.write_results(args.out, results, extra=dict(layers=args.layers,
                                                                seq=args.seq))
            del qmodel


if __name__ == "__main__":
    main()
