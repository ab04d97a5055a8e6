"""Calibrate + GPTQ a Llama of 7B shape that lives on the CPU: wall time, peak GPU memory, peak
host memory, and where each stage's time goes.

    # one GPU, sequential (the model stays on the CPU, one decoder layer at a time on the GPU)
    python -m bench.models.calib_large --mode sequential
    # at once (the whole prepared model on the GPU) vs sequential, at a depth that fits
    python -m bench.models.calib_large --mode both --layers 4
    # two GPUs: each rank calibrates half the batches, statistics merged per layer over NCCL,
    # each layer's GPTQ jobs spread over the ranks
    torchrun --nproc_per_node 2 -m bench.models.calib_large --mode sequential
    # from safetensors shards: the model on meta, each layer read from the checkpoint when it
    # runs (write the random-weight checkpoint once, in its own process, then calibrate)
    python -m bench.models.calib_large --write-shards /tmp/llama7b
    python -m bench.models.calib_large --from-shards /tmp/llama7b
    # smoke test (CPU, tiny): what CI runs
    python -m bench.models.calib_large --tiny --device cpu

Random bf16 weights (time and memory do not depend on their values): the model is built on
``meta`` and materialised parameter by parameter on the CPU, so host memory holds the 13.5 GB of
bf16 weights, the merged Q/K/V and gate/up copies ``prepare`` makes, and GPTQ's compact results.
With ``--from-shards`` the model stays on ``meta`` (``qfuse.calibrate.init_empty_weights``) and
``calibrate_sequential(weights=DIR)`` reads each stage's tensors from the checkpoint.
Calibration: ``--samples`` sequences of ``--tokens`` random token ids in batches of
``--batch-size``; int8 static (MinMax) with GPTQ. Rank 0 prints a table last and writes
``$OUT/calib_large_<mode>_<world>gpu_<layers>l.json`` (``$OUT`` or ``--out``; default
bench/results; ``_shards`` before ``.json`` for ``--from-shards``).

Time split (each stage's time, summed; CUDA synchronised at every phase boundary, so the phases
add up): ``forward`` runs the batches through the stage and its observers and Hessians;
``gptq`` rounds its layers (this rank's share); ``sync`` merges the statistics across ranks and
broadcasts GPTQ results, including the wait for the slowest rank; ``load`` reads the stage's
tensors from the checkpoint (``--from-shards``); ``other`` is the rest (moving a block to the GPU
and back, checkpoints, restoring the weights for convert at the end); ``setup`` comes before the
first stage (splitting the graph, checking the checkpoint's headers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import qfuse
from bench.harness import RESULTS
from qfuse.calibrate import calibrate_sequential, init_empty_weights, round_chains
from qfuse.pipeline.capture import inline_grad_wrappers
from qfuse.state import get_state

SEVEN_B = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=32, layers=32, vocab=32000)
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=128)


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=4096,
    )


def _bf16(model, config):
    """``model`` in bf16 with float32 rotary tables, as the checkpoints people quantize load."""
    model = model.to(torch.bfloat16)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def build_llama(shape: dict, seed: int = 0) -> torch.nn.Module:
    """LlamaForCausalLM of ``shape`` with N(0, 0.02) bf16 weights, filled parameter by
    parameter on the CPU (built on ``meta``, so no float32 copy of the model ever exists)."""
    from transformers import LlamaForCausalLM

    config = llama_config(shape)
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
    return _bf16(model, config)


def meta_llama(shape: dict) -> torch.nn.Module:
    """The same Llama with its parameters on ``meta`` (no memory) and its buffers real."""
    from transformers import LlamaForCausalLM

    config = llama_config(shape)
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    return _bf16(model, config)


def write_shards(shape: dict, folder: str) -> float:
    """Save the random-weight Llama as safetensors shards in ``folder`` (written beside it,
    then renamed: a folder that exists is complete); returns the seconds it took."""
    t0 = time.perf_counter()
    tmp = f"{folder.rstrip('/')}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    build_llama(shape).save_pretrained(tmp, max_shard_size="2GB")
    os.replace(tmp, folder)
    return time.perf_counter() - t0


def batches(samples: int, tokens: int, batch: int, vocab: int, rank: int, world: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (samples, tokens), generator=gen)
    mine = ids[rank::world]
    return [{"input_ids": mine[i : i + batch]} for i in range(0, len(mine), batch)]


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def peak_host_gb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


PHASES = {  # calibrate_sequential's functions, by the phase they time
    "_run": "forward",
    "_round_stage": "gptq",
    "sync_recorders": "sync",
    "share": "sync",
    "_place": "load",
}


class Phases:
    """Each stage's time by phase, while in ``timed()``: wraps ``calibrate_sequential``'s
    functions (``PHASES``) with timers that synchronise CUDA at each boundary; a phase nested in
    another (GPTQ's broadcast inside rounding) counts only for itself. Rank 0 prints each
    stage's start (tqdm is quiet off a terminal, and a run cut off by a time limit still says how
    far it got)."""

    def __init__(self, device, verbose: bool) -> None:
        self.device, self.verbose = device, verbose
        self.stages: list[dict] = []
        self.stack: list[list] = []  # [phase, start of its running interval]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, phase: str, seconds: float) -> None:
        if self.stages:
            self.stages[-1][phase] += seconds

    def _wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            now = self._now()
            if self.stack:
                self._add(self.stack[-1][0], now - self.stack[-1][1])
            self.stack.append([phase, now])
            try:
                return fn(*args, **kwargs)
            finally:
                now = self._now()
                self._add(phase, now - self.stack.pop()[1])
                if self.stack:
                    self.stack[-1][1] = now

        return timed

    def _walk(self, iterable):
        for stage in iterable:
            self._close()
            self.stages.append(defaultdict(float, name=stage.name, start=self._now()))
            if len(self.stages) == 1:  # before it: splitting the graph, checking the weights
                self.setup = self.stages[0]["start"] - self.t0
            if self.verbose:
                print(
                    f"stage {stage.name}: {self.stages[-1]['start'] - self.t0:.1f} s, peak "
                    f"{peak_gb(self.device):.2f} GB GPU, {peak_host_gb():.1f} GB host",
                    flush=True,
                )
            yield stage

    def _close(self) -> None:
        if self.stages and "total" not in self.stages[-1]:
            last = self.stages[-1]
            last["total"] = self._now() - last.pop("start")
            last["other"] = last["total"] - sum(last[p] for p in set(PHASES.values()))

    @contextlib.contextmanager
    def timed(self):
        import qfuse.calibrate.sequential as seq

        plain = {name: getattr(seq, name) for name in [*PHASES, "_progress"]}
        self.t0 = self._now()
        self.setup = 0.0

        def progress(iterable, desc, quiet, total=None, leave=False):
            if desc != "calibrate":
                return plain["_progress"](iterable, desc, quiet, total, leave)
            return self._walk(iterable)

        for name, phase in PHASES.items():
            setattr(seq, name, self._wrap(plain[name], phase))
        seq._progress = progress
        try:
            yield self
        finally:
            self._close()  # the last stage ends with restoring and the final barrier
            for name, fn in plain.items():
                setattr(seq, name, fn)

    def report(self) -> dict:
        """Per stage and summed, in seconds."""
        keys = ["forward", "gptq", "sync", "load", "other", "total"]
        stages = [{"name": s["name"], **{k: s[k] for k in keys}} for s in self.stages]
        split = {k: sum(s[k] for s in stages) for k in keys}
        return {"stages": stages, "split_s": {"setup": self.setup, **split}}


def run_sequential(prepared, data, device, args, weights=None) -> dict:
    phases = Phases(device, verbose=int(os.environ.get("RANK", "0")) == 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with phases.timed():
        calibrate_sequential(
            prepared,
            data,
            device=device,
            checkpoint_dir=args.checkpoint_dir,
            offload=args.offload,
            weights=weights,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "peak_gpu_gb": peak_gb(device), **phases.report()}


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
    p.add_argument(
        "--write-shards",
        metavar="DIR",
        default=None,
        help="write the random-weight Llama as safetensors shards to DIR and exit",
    )
    p.add_argument(
        "--from-shards",
        metavar="DIR",
        default=None,
        help="calibrate a meta model sequentially, reading each stage from DIR",
    )
    p.add_argument("--out", default=None, help="JSON directory (default $OUT or bench/results)")
    args = p.parse_args()

    shape = dict(TINY if args.tiny else SEVEN_B)
    if args.layers is not None:
        shape["layers"] = args.layers
    if args.write_shards:
        seconds = write_shards(shape, args.write_shards)
        print(f"wrote {args.write_shards} in {seconds:.1f} s (peak host {peak_host_gb():.1f} GB)")
        return
    if args.from_shards and args.mode != "sequential":
        sys.exit("--from-shards: --mode sequential only (the model is never loaded whole)")
    if args.from_shards and not os.path.isdir(args.from_shards):
        sys.exit(
            f"--from-shards {args.from_shards}: no such folder; write it first with "
            f"--write-shards {args.from_shards} (same --tiny/--layers)"
        )

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
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    t0 = time.perf_counter()
    model = meta_llama(shape) if args.from_shards else build_llama(shape)
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
            else run_sequential(prepared, data, device, args, weights=args.from_shards)
        )
        run["peak_host_gb"] = peak_host_gb()  # the process's peak so far
        if world > 1:  # the slowest rank and the largest peaks
            keys = ["wall_s", "peak_gpu_gb", "peak_host_gb"]
            stats = torch.tensor([run[k] for k in keys], device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            run.update(zip(keys, stats.tolist(), strict=True))
        results[mode + ("_shards" if args.from_shards else "")] = {**run, "prepare_s": prepare_s}
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
        "from_shards": args.from_shards,
        "build_s": build_s,
        "torch": torch.__version__,
        "note": "split_s: this rank's time by phase (rank 0); wall_s, peaks: max over ranks",
    }
    out_dir = Path(args.out or os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_shards" if args.from_shards else ""
    path = out_dir / f"calib_large_{args.mode}_{world}gpu_{shape['layers']}l{suffix}.json"
    path.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(
        f"\n{meta['device']} x{world}, Llama {shape['hidden']}h x {shape['layers']}L, "
        f"{args.samples} x {args.tokens} tokens -> {path}"
    )
    phases = ["forward", "gptq", "sync", "load", "other"]
    print(
        f"{'mode':<19}{'wall s':>8}{'GPU GB':>8}{'% card':>8}{'host GB':>9}{'prep s':>8}"
        + "".join(f"{p + ' s':>10}" for p in phases)
    )
    for mode, r in results.items():
        share = f"{100 * r['peak_gpu_gb'] / card_gb:.1f}" if card_gb else "-"
        split = r.get("split_s", {})
        print(
            f"{mode:<19}{r['wall_s']:>8.1f}{r['peak_gpu_gb']:>8.2f}{share:>8}"
            f"{r['peak_host_gb']:>9.1f}{r['prepare_s']:>8.1f}"
            + "".join(f"{split[p]:>10.1f}" if p in split else f"{'-':>10}" for p in phases)
        )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
