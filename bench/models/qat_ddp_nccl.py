"""QAT under DDP with NCCL on two GPUs: train a few steps, convert, check the ranks agree.

    torchrun --nproc_per_node 2 -m bench.models.qat_ddp_nccl
    python -m bench.models.qat_ddp_nccl --steps 3      # one process (CPU or one GPU)

A residual MLP-block model (LayerNorm -> Linear -> GELU -> Linear, + residual, x``--blocks``)
distils a fixed random teacher of the same shape (the student starts as the teacher with
noise on its weights) on random inputs. Two runs: observer-driven
scales (moving-average MinMax, merged across ranks every step through NCCL) and learnable
scales (LSQ, whose gradients DDP all-reduces). Each run: ``prepare_qat`` on the GPU, DDP, SGD for
``--steps`` steps on each rank's own batches, ``convert``; every rank then sends a checksum of
its converted model to rank 0, which checks they are equal. Rank 0 prints a table last and
writes ``$OUT/qat_ddp_nccl_<world>gpu.json`` (``$OUT`` or ``--out``; default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import qfuse
from bench.harness import RESULTS


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.blocks(x))


def checksum(module: nn.Module) -> torch.Tensor:
    """Sum of every state tensor (as float64) and of its squares: equal states, equal sums."""
    total = torch.zeros(2, dtype=torch.float64)
    for t in module.state_dict().values():
        v = t.detach().double().cpu()
        total += torch.stack([v.sum(), (v * v).sum()])
    return total


def train(mode: str, args, device, rank: int, world: int) -> dict:
    torch.manual_seed(0)  # same student and teacher on every rank
    teacher = Net(args.width, args.blocks).to(device).eval()
    student = Net(args.width, args.blocks).to(device)
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():  # a perturbed copy: the loss has somewhere to go
        for p in student.parameters():
            p.add_(torch.randn_like(p) * args.noise * p.std().clamp(min=1e-3))
    example = torch.randn(2, 16, args.width, device=device) * 2  # the training distribution
    qat = qfuse.prepare_qat(
        student.train(),
        qfuse.QConfig(observer="moving_average_minmax"),
        (example,),
        qat=qfuse.QATConfig(learnable_scales=mode == "lsq"),
    )
    if mode == "lsq":
        with torch.no_grad():
            qat(example)  # LSQ scales are initialised by the first batch, before DDP wraps them
    model = qat
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(qat, device_ids=ids)
    named = list(qat.named_parameters())
    scales = [p for n, p in named if n.endswith(".scale")]
    weights = [p for n, p in named if not n.endswith(".scale")]
    groups = [{"params": weights}] + ([{"params": scales, "lr": args.lr * 1e-2}] if scales else [])
    opt = torch.optim.Adam(groups, lr=args.lr)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.batch, 16, args.width, generator=gen).to(device) * 2
        with torch.no_grad():
            target = teacher(x)
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - t0
    qmodel = qfuse.convert(qat.eval())
    x = torch.randn(4, 16, args.width, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        ref, out = teacher(x), qmodel(x)
    sqnr = float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))
    sums = checksum(qmodel).to(device)
    agree = True
    if world > 1:
        gathered = [torch.empty_like(sums) for _ in range(world)]
        dist.all_gather(gathered, sums)
        agree = all(torch.equal(g, gathered[0]) for g in gathered)
    return {
        "steps": args.steps,
        "train_s": train_s,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "converted_sqnr_db": sqnr,
        "fused_layers": len(qfuse.summary(qmodel).rows),
        "ranks_identical": agree,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.3, help="student = teacher + noise * std")
    p.add_argument("--out", default=None)
    p.add_argument("--backend", default="nccl", help="gloo: a CPU check of the DDP path")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and args.backend == "nccl"
    if world > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(args.backend)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results = {mode: train(mode, args, device, rank, world) for mode in ("observer", "lsq")}
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": world,
        "backend": args.backend if world > 1 else "none",
        "torch": torch.__version__,
        "width": args.width,
        "blocks": args.blocks,
        "batch": args.batch,
    }
    out_dir = Path(args.out or os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"qat_ddp_nccl_{world}gpu.json"
    path.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(f"\n{meta['device']} x{world} ({meta['backend']}) -> {path}")
    print(
        f"{'scales':<10}{'steps':>6}{'loss first':>12}{'loss last':>11}{'train s':>9}"
        f"{'SQNR dB':>9}{'layers':>8}{'ranks equal':>13}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<10}{r['steps']:>6}{r['loss_first']:>12.4g}{r['loss_last']:>11.4g}"
            f"{r['train_s']:>9.2f}{r['converted_sqnr_db']:>9.1f}{r['fused_layers']:>8}"
            f"{str(r['ranks_identical']):>13}"
        )


if __name__ == "__main__":
    main()
