"""scikit-learn's digits (1,797 8x8 grey images, 10 classes), split deterministically.

The data ships inside scikit-learn (no download). Splits are stratified and seeded, and the
calibration split is disjoint from the held-out test split, so calibration never sees test data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DigitsSplits:
    train: tuple[torch.Tensor, torch.Tensor]
    calibration: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]


def load_digits_splits(
    seed: int = 0, test_fraction: float = 0.25, calib_size: int = 256
) -> DigitsSplits:
    """Images as float32 [N, 1, 8, 8] scaled to [0, 1], labels int64.

    Example:
        >>> splits = load_digits_splits()
        >>> splits.train[0].shape[1:], len(splits.calibration[0]), len(splits.test[0])
        (torch.Size([1, 8, 8]), 256, 450)
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    idx = torch.arange(len(y)).numpy()
    rest, test = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=y)
    train, calib = train_test_split(
        rest, test_size=calib_size, random_state=seed, stratify=y[rest].numpy()
    )
    pick = lambda i: (x[torch.as_tensor(i)], y[torch.as_tensor(i)])  # noqa: E731
    return DigitsSplits(train=pick(train), calibration=pick(calib), test=pick(test))


def batches(x: torch.Tensor, batch_size: int):
    """Consecutive mini-batches of ``x`` (the last one may be smaller)."""
    for start in range(0, len(x), batch_size):
        yield x[start : start + batch_size]
