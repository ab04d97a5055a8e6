"""qfuse's decode attention against transformers' SDPA inside one model's greedy decode.

    python -m bench.kernels.attention_parity --out $OUT/attention_parity.json   (GPU)
    python -m bench.kernels.attention_parity --tiny                           (CPU)

The TinyLlama-shape bf16 model of ``bench_llm`` (random weights), prompt 512, 32 greedy new tokens
with a static cache, run twice: with SDPA and with qfuse's attention (``integrations.attention``),
no torch.compile (each decode step runs the attention as called). Reports the first decode step's
logits' relative difference (same prefix, same cache), the first step where the tokens part,
and at that step the SDPA run's gap between its top two logits, relative to the logits' spread:
two attention kernels that round differently flip a near-tie, not a clear winner.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench import harness
from bench.models import bench_llm
from qfuse.integrations import attention


def run(model, ids, n: int, attn: str):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, cache_implementation="static",
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    shape = "tiny" if a.tiny else "tinyllama"
    device = "cpu" if a.tiny else "cuda"
    model = bench_llm.build(shape, device, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, bench_llm.PROMPT[shape]),
                        generator=torch.Generator().manual_seed(7)).to(device)
    attention.register()
    ref_tok, ref_logits = run(model, ids, a.tokens, "sdpa")
    tok, logits = run(model, ids, a.tokens, attention.NAME)
    same = (tok == ref_tok)[0]
    first_diff = int((~same).nonzero()[0, 0]) if not bool(same.all()) else None
    # step 0 is the prefill (SDPA in both); step 1 is the first decode step on equal caches
    d1 = ((logits[:, 1] - ref_logits[:, 1]).norm() / ref_logits[:, 1].norm()).item()
    row = {"tokens": a.tokens, "equal_tokens": int(same.sum()),
           "first_decode_step_logits_rel_diff": d1, "first_differing_token": first_diff}
    if first_diff is not None:
        lg = ref_logits[0, first_diff]
        top = lg.topk(2).values
        row["sdpa_top2_gap_there"] = (top[0] - top[1]).item()
        row["sdpa_logits_std_there"] = lg.std().item()
        row["qfuse_logit_diff_there"] = (logits[0, first_diff] - lg).abs().max().item()
    result = {"environment": harness.environment(), "rows": [row]}
    print(json.dumps(row), flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
