"""Calibrate + GPTQ a Llama of 7B shape that lives on the CPU: wall time and peak GPU memory.

    # one GPU, sequential (the model stays on the CPU, one decoder layer at a time on the GPU)
    PYTHONPATH=. python bench/calib_large.py --mode sequential
    # at once (the whole prepared model on the GPU) vs sequential, at a depth that fits
    PYTHONPATH=. python bench/calib_large.py --mode both --layers 4
    # two GPUs: each rank calibrates half the batches, statistics merged per layer over NCCL,
    # each layer's GPTQ jobs spread over the ranks
    PYTHONPATH=. torchrun --nproc_per_node 2 bench/calib_large.py --mode sequential
    # smoke test (CPU, tiny): what CI runs
    PYTHONPATH=. python bench/calib_large.py --tiny --device cpu

Random bf16 weights (time and memory do not depend on their values): the model is built on
``meta`` and materialised parameter by parameter on the CPU, so host memory holds the 13.5 GB of
bf16 weights, the merged Q/K/V and gate/up copies ``prepare`` makes, and GPTQ's compact results.
Calibration: ``--samples`` sequences of ``--tokens`` random token ids in batches of
``--batch-size``; int8 static (MinMax) with GPTQ. Rank 0 prints a table last and writes
``$OUT/calib_large_<mode>_<world>gpu_<layers>l.json`` (``$OUT`` or ``--out``; default
bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import qfuse
from qfuse.calibrate import calibrate_sequential, round_chains
from qfuse.capture import inline_grad_wrappers
from qfuse.state import get_state

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=32, layers=32, vocab=32000)
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=128)


def build_llama(shape: dict, seed: int = 0) -> torch.nn.Module:
    """LlamaForCausalLM of ``shape`` with N(0, 0.02) bf16 weights, filled parameter by
    parameter on the CPU (built on ``meta``, so no float32 copy of the model ever exists)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    # Windows of one 64M-value N(0, 0.02) pool at random offsets: drawing 6.7e9 normals takes
    # minutes on one core, copying takes seconds; the values do not change time or memory.
    gen = torch.Generator().manual_seed(seed)  # same weights on every rank
    size = min(1 << 26, 2 * max(p.numel() for p in model.parameters()))
    pool = torch.randn(size, generator=gen).mul_(0.02).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), pool.numel() // 2):
                n = min(pool.numel() // 2, flat.numel() - start)
                off = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=gen))
                flat[start : start + n].copy_(pool[off : off + n])
    # the rotary tables are buffers computed at construction, which meta left empty
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def batches(samples: int, tokens: int, batch: int, vocab: int, rank: int, world: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (samples, tokens), generator=gen)
    mine = ids[rank::world]
    return [{"input_ids": mine[i : i + batch]} for i in range(0, len(mine), batch)]


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


@contextlib.contextmanager
def _log_stages(device):
    """Print each stage's start (elapsed seconds, peak GPU memory so far) on rank 0 while in
    the block: tqdm is quiet off a terminal, and a run cut off by a time limit still says how
    far it got."""
    import qfuse.calibrate.sequential as seq

    plain, t0 = seq._progress, time.perf_counter()

    def stages(iterable, desc, quiet, total=None, leave=False):
        if desc != "calibrate":
            return plain(iterable, desc, quiet, total, leave)

        def walk():
            for stage in iterable:
                print(f"stage {stage.name}: {time.perf_counter() - t0:.1f} s, peak "
                      f"{peak_gb(device):.2f} GB", flush=True)
                yield stage

        return walk()

    seq._progress = stages
    try:
        yield
    finally:
        seq._progress = plain


def run_sequential(prepared, data, device, args) -> dict:
    log = _log_stages(device) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with log:
        calibrate_sequential(
            prepared, data, device=device, checkpoint_dir=args.checkpoint_dir,
            offload=args.offload,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"wall_s": time.perf_counter() - t0, "peak_gpu_gb": peak_gb(device)}


def run_at_once(prepared, data, device) -> dict:
    """The whole prepared model on the device: every batch through it, then GPTQ per layer."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    inline_grad_wrappers(prepared)  # as calibrate_sequential: torch 2.11's no_grad subgraphs
    prepared.to(device)
    with torch.no_grad():
        for b in data:
            prepared(**{k: v.to(device) for k, v in b.items()})
    round_chains(prepared, get_state(prepared).chains)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {"wall_s": time.perf_counter() - t0, "peak_gpu_gb": peak_gb(device)}
    prepared.to("cpu")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["sequential", "at_once", "both"], default="sequential")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (7B: 32)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--samples", type=int, default=128, help="calibration sequences")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide Llama (CI smoke)")
    p.add_argument("--device", default=None, help="default: cuda (this rank's GPU) if present")
    p.add_argument("--offload", action="store_true", help="cached activations on the CPU")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--out", default=None, help="JSON directory (default $OUT or bench/results)")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
    device = torch.device(
        args.device
        or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    )
    if world > 1 and args.mode != "sequential":
        sys.exit("several ranks: --mode sequential only (at once is the one-GPU baseline)")
    shape = dict(TINY if args.tiny else SEVEN_B)
    if args.layers is not None:
        shape["layers"] = args.layers
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    t0 = time.perf_counter()
    model = build_llama(shape)
    build_s = time.perf_counter() - t0
    data = batches(args.samples, args.tokens, args.batch_size, shape["vocab"], rank, world)
    example = {"input_ids": data[0]["input_ids"][:2, :16]}
    results = {}
    for mode in ["at_once", "sequential"] if args.mode == "both" else [args.mode]:
        t0 = time.perf_counter()
        prepared = qfuse.prepare(
            model, qfuse.QConfig.int8_static(), (), example_kwargs=example, gptq=qfuse.GPTQ()
        )
        prepare_s = time.perf_counter() - t0
        run = (
            run_at_once(prepared, data, device)
            if mode == "at_once"
            else run_sequential(prepared, data, device, args)
        )
        if world > 1:  # the slowest rank and the largest peak
            stats = torch.tensor([run["wall_s"], run["peak_gpu_gb"]], device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            run["wall_s"], run["peak_gpu_gb"] = stats.tolist()
        results[mode] = {**run, "prepare_s": prepare_s}
        del prepared

    if rank != 0:
        dist.destroy_process_group()
        return
    card_gb = (
        torch.cuda.get_device_properties(device).total_memory / 2**30
        if device.type == "cuda"
        else None
    )
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "card_gb": card_gb,
        "gpus": world,
        "shape": shape,
        "samples": args.samples,
        "tokens": args.tokens,
        "batch_size": args.batch_size,
        "offload": args.offload,
        "build_s": build_s,
        "torch": torch.__version__,
    }
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"calib_large_{args.mode}_{world}gpu_{shape['layers']}l.json"
    path.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(
        f"\n{meta['device']} x{world}, Llama {shape['hidden']}h x {shape['layers']}L, "
        f"{args.samples} x {args.tokens} tokens -> {path}"
    )
    print(f"{'mode':<12}{'wall s':>9}{'peak GPU GB':>13}{'% of card':>11}{'prepare s':>11}")
    for mode, r in results.items():
        share = f"{100 * r['peak_gpu_gb'] / card_gb:.1f}" if card_gb else "-"
        print(
            f"{mode:<12}{r['wall_s']:>9.1f}{r['peak_gpu_gb']:>13.2f}{share:>11}"
            f"{r['prepare_s']:>11.1f}"
        )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
