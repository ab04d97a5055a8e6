"""QAT of the digits CNN+MLP on a configuration where PTQ loses, on one process or N (DDP).

    python -m qfuse.recipes.qat_digits                    # fp32 / PTQ / QAT accuracy side by side
    python -m qfuse.recipes.qat_digits --ddp 2           # QAT (and PTQ calibration) on 2 processes:
                                                    # gloo on CPU, nccl with one GPU per process
    torchrun --nproc-per-node 2 -m qfuse.recipes.qat_digits   # the same under torchrun

The hard configuration: int8 with per-tensor weights, and planted activation outliers: two
channels after each Conv+BN are scaled up 80x (BatchNorm's gamma and beta) and the next layer's
weights for them scaled down 80x, which leaves the float model's function unchanged (ReLU is
positively homogeneous) but wrecks one-scale-per-tensor int8 (PTQ). QAT starts from PTQ's
scales, learns its scales (LSQ) and distils the float model's logits (plus the labels).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from qfuse.calibration.digits import batches, load_digits_splits
from qfuse.recipes.ptq_digits import accuracy, load_or_train
from torch import nn
from tqdm.auto import tqdm

import qfuse

CONFIG = qfuse.QConfig(weight_granularity=qfuse.PerTensor())  # int8, per-tensor weights
FACTOR = 80.0  # outlier channels' scale-up


@torch.no_grad()
def plant_outliers(model: nn.Module, calib, factor: float = FACTOR, per_layer: int = 2):
    """A copy with ``per_layer`` channels after bn1 and bn2 scaled by ``factor`` and the next
    layer's weights for them by ``1 / factor`` (same float function). The channels picked are
    those whose removal changes the calibration loss least (outliers in a minor channel)."""
    model = copy.deepcopy(model).eval()
    x, y = calib
    base = nn.functional.cross_entropy(model(x), y)

    def least_important(bn):
        cost = []
        for c in range(bn.num_features):
            saved = bn.weight[c].clone(), bn.bias[c].clone()
            bn.weight[c], bn.bias[c] = 0.0, -10.0  # ReLU(-10) = 0: channel off
            cost.append((nn.functional.cross_entropy(model(x), y) - base).abs().item())
            bn.weight[c], bn.bias[c] = saved
        return torch.tensor(cost).argsort()[:per_layer].tolist()

    fc1_in = model.fc1.weight.view(model.fc1.out_features, model.bn2.num_features, -1)
    for bn, next_weight in ((model.bn1, model.conv2.weight), (model.bn2, fc1_in)):
        for c in least_important(bn):
            bn.weight[c] *= factor
            bn.bias[c] *= factor
            next_weight[:, c] /= factor
    return model


def calibrate(model, calib_x, rank: int, world: int):
    """PTQ: each process calibrates on its shard; ``sync_observers`` merges them."""
    prepared = qfuse.prepare(model, CONFIG, example_inputs=(calib_x[:8],))
    with torch.no_grad():
        for xb in batches(calib_x[rank::world], 64):
            prepared(xb)
    qfuse.sync_observers(prepared)
    return prepared


def qat_finetune(teacher, prepared, splits, epochs, lr, rank, world, device, progress):
    """LSQ QAT from PTQ's scales; DDP when ``world`` > 1. Returns the QAT model (eval mode)."""
    calib_x, _ = splits.calibration
    student = copy.deepcopy(teacher).train()
    student.dropout.p = 0.0  # distillation: train the function that will be served
    qat = qfuse.prepare_qat(
        student,
        CONFIG,
        example_inputs=(calib_x[:8],),
        qat=qfuse.QATConfig(learnable_scales=True, bn_freeze_step=0),
        from_prepared=prepared,
    ).to(device)
    teacher = teacher.to(device).eval()
    model = qat
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(qat, device_ids=ids)
    # Scales span orders of magnitude (0.5 for an outlier tensor, 1e-3 elsewhere) and Adam steps
    # by about lr whatever the gradient: each scale gets a learning rate relative to itself.
    named = list(qat.named_parameters())
    groups = [{"params": [p for n, p in named if not n.endswith(".scale")]}]
    groups += [
        {"params": [p], "lr": 0.05 * p.detach().abs().mean().item()}
        for n, p in named
        if n.endswith(".scale")
    ]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    x, y = splits.train
    per_epoch = len(x) // 64
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * per_epoch)
    gen = torch.Generator().manual_seed(1)
    val_x = calib_x.to(device)
    with torch.no_grad():
        val_target = teacher(val_x).log_softmax(-1)
    best = (float("inf"), None)
    bar = tqdm(total=epochs * per_epoch, desc=f"QAT ({world} proc)", disable=not progress)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=gen)  # same on every rank: shard by rank
        for idx in perm[: per_epoch * 64].split(64):
            idx = idx[rank::world]
            xb, yb = x[idx].to(device), y[idx].to(device)
            logits = model(xb)
            with torch.no_grad():
                target = teacher(xb).log_softmax(-1)
            loss = nn.functional.kl_div(
                logits.log_softmax(-1), target, log_target=True, reduction="batchmean"
            ) + 0.5 * nn.functional.cross_entropy(logits, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        # Keep the epoch whose fake-quant model is closest to the teacher on the calibration
        # split (never the test split); every rank sees the same split and picks the same one.
        with torch.no_grad():
            val = nn.functional.kl_div(
                qat.eval()(val_x).log_softmax(-1),
                val_target,
                log_target=True,
                reduction="batchmean",
            ).item()
        if val < best[0]:
            best = (val, copy.deepcopy(qat.state_dict()))
    bar.close()
    qat.load_state_dict(best[1])
    return qat.eval()


def fingerprint(qmodel) -> torch.Tensor:
    """Sum of every converted tensor in float64: equal on every rank when the models are."""
    return sum(t.double().sum() for t in qmodel.state_dict().values()).reshape(1)


def run(
    epochs: int = 6,
    lr: float = 5e-5,
    float_epochs: int = 40,
    factor: float = FACTOR,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    device: str | None = None,
    progress: bool = True,
) -> dict:
    """fp32 / PTQ / QAT top-1 on the test split (every rank returns the same numbers)."""
    dev = torch.device(device or "cpu")
    splits = load_digits_splits(seed=seed)
    if world > 1 and rank != 0:
        dist.barrier()  # rank 0 trains (or loads) and caches the float model first
    model = load_or_train(splits, float_epochs, seed, use_cache=True)
    if world > 1 and rank == 0:
        dist.barrier()
    teacher = plant_outliers(model, splits.calibration, factor)
    test_x, test_y = splits.test
    calib_x, _ = splits.calibration
    prepared = calibrate(teacher, calib_x, rank, world)
    ptq = qfuse.convert(prepared)
    qat = qat_finetune(teacher, prepared, splits, epochs, lr, rank, world, dev, progress)
    qmodel = qfuse.convert(qat.cpu())
    result = {
        "fp32_float": accuracy(model, test_x, test_y, torch.device("cpu")),
        "fp32": accuracy(teacher.cpu(), test_x, test_y, torch.device("cpu")),
        "ptq": accuracy(ptq, test_x, test_y, torch.device("cpu")),
        "qat_fake_quant": accuracy(qat, test_x, test_y, torch.device("cpu")),
        "qat": accuracy(qmodel, test_x, test_y, torch.device("cpu")),
        "summary": qfuse.summary(qmodel),
        "world": world,
        "ranks_agree": True,
    }
    if world > 1:
        fp = fingerprint(qmodel).to(dev if dist.get_backend() == "nccl" else "cpu")
        lo, hi = fp.clone(), fp.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        result["ranks_agree"] = bool(lo == hi)
    return result


def report(r: dict, device: str) -> None:
    print(
        f"\nDigits CNN+MLP, int8 per-tensor weights + planted outliers ({device}, {r['world']} "
        "process(es), test split of 450 images)\n"
    )
    print(f"{'model':<34}{'top-1 %':>9}{'vs fp32':>9}")
    for key, name in (
        ("fp32", "fp32 (outliers planted)"),
        ("ptq", "PTQ int8 (per-tensor weights)"),
        ("qat", "QAT int8, converted"),
    ):
        print(f"{name:<34}{r[key]:>9.2f}{r[key] - r['fp32']:>+9.2f}")
    print(
        f"\nQAT fake-quant model {r['qat_fake_quant']:.2f}; all ranks converted to the same "
        f"model: {r['ranks_agree']}\n\n{r['summary']}"
    )


def _ddp_main(rank: int, world: int, args) -> None:
    use_cuda = torch.cuda.is_available() and not args.cpu
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    try:
        device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        r = run(
            args.epochs,
            args.lr,
            factor=args.factor,
            rank=rank,
            world=world,
            device=device,
            progress=rank == 0 and not args.quiet,
        )
        if rank == 0:
            name = torch.cuda.get_device_name() if use_cuda else "cpu"
            report(r, f"{name}, {dist.get_backend()}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--factor", type=float, default=FACTOR, help="outlier scale-up")
    parser.add_argument("--ddp", type=int, default=1, help="processes (DDP) to spawn")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even with GPUs")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _ddp_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    elif args.ddp > 1:
        torch.multiprocessing.spawn(_ddp_main, args=(args.ddp, args), nprocs=args.ddp)
    else:
        report(run(args.epochs, args.lr, factor=args.factor, progress=not args.quiet), "cpu")


if __name__ == "__main__":
    main()
