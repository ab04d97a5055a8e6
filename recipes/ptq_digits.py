"""Static INT8 (and FP8) PTQ of a small CNN+MLP on scikit-learn's digits: the qfuse main job.

    python -m qfuse.recipes.ptq_digits         # trains (or loads the cached checkpoint), quantizes,
                                            # prints fp32 vs int8/fp8 accuracy, latency, fusion

Runs on CPU in well under 2 minutes on 2 cores (the torch reference kernels) and on CUDA when
present (the Triton kernels).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from qfuse.calibration.digits import batches, load_digits_splits
from torch import nn

import qfuse
from qfuse.fileio import atomic_path
from qfuse.tools.timing import median_ms

CACHE = Path(__file__).resolve().parent / ".cache"


class DigitsNet(nn.Module):
    """Conv-BN-ReLU x2 -> max-pool -> Linear-ReLU -> Linear: 8x8 grey image -> 10 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.dropout = nn.Dropout(0.2)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(self.dropout(x))


def train(splits, epochs: int, seed: int) -> DigitsNet:
    torch.manual_seed(seed)
    model = DigitsNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * 18)
    x, y = splits.train
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for idx in perm.split(64)[:18]:
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def load_or_train(splits, epochs: int, seed: int, use_cache: bool) -> DigitsNet:
    path = CACHE / f"digits_net_seed{seed}_e{epochs}.pt"
    if use_cache and path.exists():
        model = DigitsNet()
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval()
    model = train(splits, epochs, seed)
    if use_cache:
        CACHE.mkdir(exist_ok=True)
        with atomic_path(path) as tmp:  # a per-writer temp name: parallel trainers never collide
            torch.save(model.state_dict(), tmp)
    return model


@torch.no_grad()
def accuracy(model, x, y, device, batch_size: int = 256) -> float:
    correct = 0
    for xb, yb in zip(batches(x, batch_size), batches(y, batch_size), strict=False):
        correct += (model(xb.to(device)).argmax(-1).cpu() == yb).sum().item()
    return 100.0 * correct / len(y)


@torch.no_grad()
def latency_ms(model, x, device, repeats: int = 20) -> float:
    """Median ms of one forward over batch ``x`` (``qfuse.tools.timing``: do_bench on CUDA)."""
    x = x.to(device)
    return median_ms(lambda: model(x), device, warmup=3, repeats=repeats)


def run(epochs: int = 40, seed: int = 0, use_cache: bool = True, device: str | None = None) -> dict:
    """Train/load, quantize, evaluate. Returns the numbers the table prints."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    splits = load_digits_splits(seed=seed)
    model = load_or_train(splits, epochs, seed, use_cache)

    calib_x, _ = splits.calibration
    test_x, test_y = splits.test
    batch = test_x[:256]
    return ptq_results(model, calib_x, test_x, test_y, batch, dev)


# name -> (QConfig, GPTQ or None): weights rounded to nearest unless a recipe asks for GPTQ
PTQ_CONFIGS = {
    "int8": (qfuse.QConfig.int8_static(), None),
    "fp8": (qfuse.QConfig.fp8_static(), None),
}


def ptq_results(model, calib_x, test_x, test_y, batch, dev, configs=None) -> dict:
    """fp32 against int8 and fp8 static PTQ of ``model`` (calibrated on ``calib_x`` in batches of
    64): top-1 % on the test split, latency of one forward of ``batch``, and each summary.
    ``configs``: name -> (QConfig, GPTQ or None), ``PTQ_CONFIGS`` by default."""
    model = model.to(dev)
    result = {
        "device": dev.type if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "batch": len(batch),
        "fp32_top1": accuracy(model, test_x, test_y, dev),
        "fp32_ms": latency_ms(model, batch, dev),
    }
    for name, (config, gptq) in (configs or PTQ_CONFIGS).items():
        prepared = qfuse.prepare(model.cpu(), config, example_inputs=(calib_x[:8],), gptq=gptq)
        with torch.no_grad():
            for xb in batches(calib_x, 64):
                prepared(xb)
        qmodel = qfuse.convert(prepared).to(dev)
        model = model.to(dev)
        result[f"{name}_top1"] = accuracy(qmodel, test_x, test_y, dev)
        result[f"{name}_ms"] = latency_ms(qmodel, batch, dev)
        result[f"{name}_summary"] = qfuse.summary(qmodel)
    result["summary"] = result["int8_summary"]
    return result


def print_results(r: dict) -> None:
    """The recipe's table: top-1, drop against fp32 and latency per model, then the summary."""
    print(f"{'model':<8}{'top-1 %':>10}{'drop':>8}{'latency/batch of ' + str(r['batch']):>26}")
    for name in ("fp32", "int8", "fp8"):
        drop = r["fp32_top1"] - r[f"{name}_top1"]
        print(f"{name:<8}{r[f'{name}_top1']:>10.2f}{drop:>8.2f}{r[f'{name}_ms']:>23.2f} ms")
    print(f"\nfused layers (int8):\n{r['int8_summary']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="retrain, do not read/write cache")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    args = parser.parse_args()
    r = run(args.epochs, args.seed, not args.no_cache, args.device)
    print(f"\nDigits CNN+MLP, static PTQ ({r['device']}, test split of 450 images)\n")
    print_results(r)


def sweep_spec(reduced: bool = False, seed: int = 0):
    """The digits net as a ``qfuse sweep`` recipe: top-1 % on the 450-image test split; ``best``
    tunes on the calibration split's labels (never the test split).

    ``reduced`` (CI): 10 training epochs, 64 calibration images, the first 128 test images,
    latency on a batch of 32.

    Example:
        >>> spec = sweep_spec(reduced=True)
        >>> spec.metric, len(spec.calibration), tuple(spec.example.shape)
        ('top-1 %', 1, (32, 1, 8, 8))
    """
    splits = load_digits_splits(seed=seed)
    epochs = 10 if reduced else 40
    model = load_or_train(splits, epochs, seed, use_cache=True)
    return digits_spec(
        "digits", model, splits.calibration, splits.test, reduced,
        f"Digits CNN+MLP (conv-BN-ReLU x2, Linear-ReLU, Linear; {epochs} epochs)")


def digits_spec(name, model, calibration, test, reduced, what, example_format=None):
    """A digits classifier as a ``SweepSpec`` (this recipe's and ``ptq_resnet``'s): top-1 % on
    the ``test`` (x, y) split, ``best`` tuned on the ``calibration`` split's labels; reduced:
    64 calibration and 128 test images, latency on a batch of 32 (else 256), in
    ``example_format`` (a ``torch.memory_format``) when given."""
    from qfuse.tools import SweepSpec

    (calib_x, calib_y), (test_x, test_y) = calibration, test
    if reduced:
        calib_x, calib_y, test_x, test_y = calib_x[:64], calib_y[:64], test_x[:128], test_y[:128]
    example = test_x[: 32 if reduced else 256]
    if example_format is not None:
        example = example.contiguous(memory_format=example_format)
    cpu = torch.device("cpu")
    return SweepSpec(
        name=name,
        model=model,
        calibration=list(batches(calib_x, 64)),
        evaluate=lambda m: accuracy(m, test_x, test_y, cpu),
        validate=lambda m: accuracy(m, calib_x, calib_y, cpu),
        example=example,
        metric="top-1 %",
        default_max_drop=0.5,  # percentage points of top-1
        description=(
            f"{what}, scikit-learn digits: top-1 % on {len(test_y)} held-out test images; "
            f"calibration {len(calib_y)} images; latency: one forward of a batch of "
            f"{len(example)}."
        ),
    )

if __name__ == "__main__":
    main()
