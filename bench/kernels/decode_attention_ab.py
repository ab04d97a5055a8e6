"""Decode attention at TinyLlama's shape (H=32 query heads, Hkv=4 kv heads, D=64, one query
token, a static bf16 cache of L positions): what transformers' SDPA path runs against
``qfuse::decode_attention``, by GPU time of CUDA-graph replays.

    python -m bench.kernels.decode_attention_ab --out $OUT/decode_attn.json

Rows per (batch, L):
- ``hf_repeat_kv_sdpa``: ``repeat_kv`` of K and V (the G-fold copy of the cache), SDPA with the
  static cache's boolean mask, the [B, 1, H, D] transpose copy: ``sdpa_attention_forward`` as it
  runs compiled (and always in transformers 5.17).
- ``hf_compiled``: the same under ``torch.compile`` (as ``generate()`` compiles a static-cache
  decode step; in a model Inductor also fuses RoPE into the copy).
- ``sdpa_pack_gqa_mask``: transformers 5.24's eager single-token path: q viewed as [B, Hkv, G, D],
  SDPA with the mask broadcast over the G rows (no copy of the cache).
- ``sdpa_gqa_nomask``: SDPA with ``enable_gqa=True`` and no mask (what SDPA does when no mask
  forces it off its fused kernels; attends to the whole cache, so it is checked against the
  unmasked reference).
- ``qfuse``: the op as a model calls it; ``qfuse[block_l,warps,stages]``: other schedules of the
  kernel (``--sweep``), to choose ``kernels.decode_attention.default_schedule``.
Every row is checked against the float32 reference first (``ops.decode_attention.reference``);
a failing row carries ``error`` and no time. The cache is filled to 3/4 of L, sample b left-padded
by 3*b positions.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import qfuse.ops.decode_attention  # noqa: F401 - registers the op
from bench import harness as H
from qfuse.kernels.attention import decode as kernels
from qfuse.kernels.attention.decode import DecodeSchedule
from qfuse.ops.decode_attention import reference

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 64
SWEEP = [DecodeSchedule(32, 4, 2), DecodeSchedule(64, 4, 3), DecodeSchedule(128, 4, 2),
         DecodeSchedule(128, 8, 3), DecodeSchedule(64, 2, 2)]
MAX_ERR = 2e-2


def inputs(B, L, Sq):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, Sq, HEADS, HEAD_DIM, device=DEVICE, generator=g).to(torch.bfloat16)
    q = q.transpose(1, 2)  # Llama's [B, H, Sq, D] view of the projection
    k, v = (torch.randn(B, KV_HEADS, L, HEAD_DIM, device=DEVICE, generator=g)
            .to(torch.bfloat16) for _ in range(2))
    pos = torch.arange(L, device=DEVICE)
    filled = 3 * L // 4
    pad = 3 * torch.arange(B, device=DEVICE)
    rows = [(pos[None, :] >= pad[:, None]) & (pos[None, :] <= filled - Sq + i) for i in range(Sq)]
    mask = torch.stack(rows, dim=1)[:, None]  # [B, 1, Sq, L]
    return q, k, v, mask


def repeat_kv(x, n):
    B, Hkv, L, D = x.shape
    return x[:, :, None].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)


def impls(q, k, v, mask, sweep):
    G = HEADS // KV_HEADS
    B, _, Sq, D = q.shape

    def hf():
        o = F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), mask)
        return o.transpose(1, 2).contiguous()

    def pack_gqa():
        o = F.scaled_dot_product_attention(q.reshape(B, KV_HEADS, G, D), k, v, mask)
        return o.reshape(B, HEADS, Sq, D).transpose(1, 2).contiguous()

    def gqa():
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return o.transpose(1, 2).contiguous()

    compiled = torch.compile(hf, fullgraph=True)  # Inductor fuses repeat_kv's copy
    rows = [("hf_repeat_kv_sdpa", hf, True), ("hf_compiled", compiled, True),
            ("gqa_nomask", gqa, False),
            ("qfuse", lambda: torch.ops.qfuse.decode_attention(q, k, v, mask, None), True)]
    if Sq == 1:  # pack_gqa as transformers 5.24 does it: one query position only
        rows.insert(1, ("sdpa_pack_gqa_mask", pack_gqa, True))
    for s in sweep:
        def run(s=s):
            capturing = torch.cuda.is_current_stream_capturing()
            return kernels.decode_attention(q, k, v, mask, None, False, schedule=s,
                                            tracing=capturing)
        rows.append((f"qfuse[{s.block_l},{s.num_warps},{s.num_stages}]", run, True))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--length", default="600,2048,8192")
    ap.add_argument("--sq", type=int, default=1, help="query positions (1: plain decode)")
    ap.add_argument("--sweep", action="store_true", help="time other kernel schedules too")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for B in map(int, a.batch.split(",")):
        for L in map(int, a.length.split(",")):
            q, k, v, mask = inputs(B, L, a.sq)
            ref = {masked: reference(q.float(), k.float(), v.float(), mask if masked else None,
                                     None).double() for masked in (True, False)}
            kv_bytes = 2 * k.numel() * k.element_size()
            flops = 4 * B * HEADS * a.sq * L * HEAD_DIM
            for name, fn, masked in impls(q, k, v, mask, SWEEP if a.sweep else []):
                row = {"batch": B, "length": L, "sq": a.sq, "dtype": "bf16", "impl": name}
                H.measure(row, fn, ref[masked], flops, MAX_ERR, graph=True)
                if "graph_us" in row:
                    row["kv_TBps"] = kv_bytes / (row["graph_us"] * 1e-6) / 1e12
                rows.append(row)
                if a.out:  # rewritten after every row: a cut-off run keeps what ran
                    H.write_results(a.out, rows, {"heads": HEADS, "kv_heads": KV_HEADS,
                                                  "head_dim": HEAD_DIM})
    print(f"\n{'B':>3} {'L':>5} {'impl':>22} {'graph us':>9} {'eager us':>9} {'x hf':>6} "
          f"{'KV TB/s':>8} {'launch':>6} {'relerr':>8}")
    for r in rows:
        if "graph_us" not in r:
            print(f"{r['batch']:>3} {r['length']:>5} {r['impl']:>22}  "
                  f"{r.get('error') or r.get('graph_error', '')}"[:120])
            continue
        hf = next((x for x in rows if x["batch"] == r["batch"] and x["length"] == r["length"]
                   and x["impl"] == "hf_repeat_kv_sdpa" and "graph_us" in x), None)
        ratio = hf["graph_us"] / r["graph_us"] if hf else 0.0
        print(f"{r['batch']:>3} {r['length']:>5} {r['impl']:>22} {r['graph_us']:9.1f} "
              f"{r['median_us']:9.1f} {ratio:6.2f} {r['kv_TBps']:8.2f} "
              f"{r.get('launches', -1):6d} {r['max_rel_err']:8.2e}")


if __name__ == "__main__":
    main()
