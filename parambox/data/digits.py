"""``digits``: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), no download needed."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import torch

from parambox.data.base import Dataset
from parambox.data.registry import register
from parambox.data.transforms import channel_stats, normalise_

# The split does not follow the run seed, so test accuracies of different runs are comparable.
SPLIT_SEED = 0
TEST_FRACTION = 0.2


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices holding ``test_fraction`` of every class in the test part, sorted.

    >>> tr, te = stratified_split(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1]), 0.5, 0)
    >>> len(tr), len(te)
    (5, 5)
    """
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test.append(members[: int(round(len(members) * test_fraction))])
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(len(y)), test_idx)
    return train_idx, test_idx


@register("digits")
def load_digits(data_path: Path | None, seed: int) -> Dataset:
    """1,438 train / 359 test images, (N, 1, 8, 8), normalised with the train set's mean and std."""
    del seed  # the split is fixed on purpose
    if data_path is not None:
        warnings.warn(
            f"data set 'digits' ships with scikit-learn; ignoring data path {data_path}", stacklevel=2
        )
    images, target = _read_digits()
    x = torch.from_numpy(images).unsqueeze(1)
    y = torch.from_numpy(target)
    train_idx, test_idx = stratified_split(target, TEST_FRACTION, SPLIT_SEED)
    train_x, test_x = x[train_idx], x[test_idx]
    mean, std = channel_stats(train_x, per_channel=False)
    return Dataset(
        name="digits",
        train_x=normalise_(train_x, mean, std),
        train_y=y[train_idx],
        test_x=normalise_(test_x, mean, std),
        test_y=y[test_idx],
        num_classes=10,
    )


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's own file (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the label a
    row), read without importing scikit-learn, whose import takes ~2 s, longer than a short run;
    ``sklearn.datasets.load_digits`` where a release keeps the file elsewhere."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            rows = np.loadtxt(path, delimiter=",", dtype=np.float32)
            return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return bunch.images.astype(np.float32), bunch.target.astype(np.int64)
