"""Generated data sets: ``synthetic`` (learnable image-shaped classes) and ``step`` (SHM-Learn-Dist §3).

Both are drawn from the run seed, need no files and load in milliseconds, so tests and smoke
runs use them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from parambox.data.base import Dataset
from parambox.data.registry import register
from parambox.data.transforms import channel_stats, normalise_

SYNTHETIC_TRAIN, SYNTHETIC_TEST = 8192, 2048
SYNTHETIC_SHAPE = (1, 8, 8)
SYNTHETIC_CLASSES = 10
# Norm of each class mean against unit per-pixel noise: it sets how often the Bayes-optimal
# (nearest-mean) classifier is right, ~97 % here, so the task is learnable but not trivial.
SYNTHETIC_MEAN_NORM = 4.0
# The same task at CIFAR's size, for benchmarks of the image models where no CIFAR files are at hand.
SYNTHETIC32_TRAIN, SYNTHETIC32_TEST = 4096, 1024
SYNTHETIC32_SHAPE = (3, 32, 32)

# §3 trains for 10,000 steps per worker; 10,000 samples make that one epoch at batch 1.
STEP_TRAIN, STEP_TEST = 10_000, 1_000


def _ignored_path(name: str, data_path: Path | None) -> None:
    if data_path is not None:
        warnings.warn(f"data set {name!r} is generated; ignoring data path {data_path}", stacklevel=3)


def _class_means(g: torch.Generator, shape: tuple[int, int, int] = SYNTHETIC_SHAPE) -> torch.Tensor:
    # Smooth blobs (4x4 noise upsampled to 8x8), so neighbouring pixels correlate as in images
    # and convolutions have something to find; scaled to a fixed norm so every pair of classes
    # is about equally hard.
    c, h, w = shape
    coarse = torch.randn(SYNTHETIC_CLASSES, c, h // 2, w // 2, generator=g)
    means = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    flat = means.flatten(1)
    flat = flat - flat.mean(dim=0, keepdim=True)
    flat = flat / flat.norm(dim=1, keepdim=True) * SYNTHETIC_MEAN_NORM
    return flat.reshape(SYNTHETIC_CLASSES, c, h, w)


def _draw(means: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, len(means), (n,), generator=g)
    x = means[y] + torch.randn(n, *means.shape[1:], generator=g)
    return x, y


@register("synthetic")
def load_synthetic(data_path: Path | None, seed: int) -> Dataset:
    """Ten Gaussian classes around smooth 8x8 mean images, unit noise; (N, 1, 8, 8), normalised."""
    _ignored_path("synthetic", data_path)
    return _synthetic("synthetic", SYNTHETIC_SHAPE, SYNTHETIC_TRAIN, SYNTHETIC_TEST, seed)


@register("synthetic32")
def load_synthetic32(data_path: Path | None, seed: int) -> Dataset:
    """``synthetic`` at CIFAR's size: (N, 3, 32, 32), 4,096 training and 1,024 test images."""
    _ignored_path("synthetic32", data_path)
    return _synthetic("synthetic32", SYNTHETIC32_SHAPE, SYNTHETIC32_TRAIN, SYNTHETIC32_TEST, seed)


def _synthetic(name: str, shape: tuple[int, int, int], n_train: int, n_test: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    means = _class_means(g, shape)
    train_x, train_y = _draw(means, n_train, g)
    test_x, test_y = _draw(means, n_test, g)
    mean, std = channel_stats(train_x, per_channel=False)
    return Dataset(
        name=name,
        train_x=normalise_(train_x, mean, std),
        train_y=train_y,
        test_x=normalise_(test_x, mean, std),
        test_y=test_y,
        num_classes=SYNTHETIC_CLASSES,
    )


@register("step")
def load_step(data_path: Path | None, seed: int) -> Dataset:
    """SHM-Learn-Dist Eq. 3.1: x ~ U[0, 1), label 0 if x < 0.5 else 1; (N, 1), not normalised.

    Kept raw so a single sigmoid neuron's weight and bias read as in the report: the decision
    boundary -b/w should approach 0.5.
    """
    _ignored_path("step", data_path)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(STEP_TRAIN + STEP_TEST, 1, generator=g)
    y = (x[:, 0] >= 0.5).long()
    return Dataset(
        name="step",
        train_x=x[:STEP_TRAIN].clone(),
        train_y=y[:STEP_TRAIN].clone(),
        test_x=x[STEP_TRAIN:].clone(),
        test_y=y[STEP_TRAIN:].clone(),
        num_classes=2,
    )
