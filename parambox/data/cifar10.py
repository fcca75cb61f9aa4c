"""``cifar10``: the CIFAR-10 python batches (``data_batch_1..5``, ``test_batch``) from a local folder.

``data_path`` is the ``cifar-10-batches-py`` folder or its parent (where the archive was
unpacked). Each batch is a pickled dict with ``data``, uint8 (N, 3072) in R, G, B planes, and
``labels``; it is read with the restricted unpickler, never with plain pickle.
Train images are augmented with a padded random crop and a random horizontal flip.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from parambox.data.base import Dataset
from parambox.data.registry import register
from parambox.data.transforms import channel_stats, crop_and_flip, normalise_
from parambox.data.unpickle import load_restricted
from parambox.errors import UserError

FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
NUM_CLASSES = 10


def batches_folder(data_path: Path | None) -> Path:
    """The folder holding the batch files: ``data_path`` itself or its ``cifar-10-batches-py``."""
    if data_path is None:
        raise UserError(
            f"data set 'cifar10' needs a data path: the {FOLDER} folder of "
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, unpacked"
        )
    if (data_path / FOLDER / TEST_BATCH).is_file():
        return data_path / FOLDER
    if not data_path.is_dir():
        raise UserError(f"{data_path}: no such folder (expected the {FOLDER} folder or its parent)")
    return data_path


def _field(batch: dict, name: str, path: Path):
    # Python 2 pickles decode their str keys to str with latin1; re-pickled ones may have bytes keys.
    for key in (name, name.encode()):
        if key in batch:
            return batch[key]
    raise UserError(f"{path}: no {name!r} entry; is this a CIFAR-10 python batch?")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 images (N, 3, 32, 32), int64 labels (N,)), validated."""
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    batch = load_restricted(path)
    if not isinstance(batch, dict):
        raise UserError(f"{path}: expected a pickled dict, found {type(batch).__name__}")
    data = _field(batch, "data", path)
    labels = np.asarray(_field(batch, "labels", path))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise UserError(f"{path}: 'data' must be a uint8 array of shape (N, 3072), found {shape}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"{path}: 'labels' must hold {len(data)} integers, found shape {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise UserError(f"{path}: labels range over [{labels.min()}, {labels.max()}], expected 0..9")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_split(folder: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [read_batch(folder / name) for name in names]
    # One float32 tensor filled batch by batch: the train set is 614 MB as float32, so no
    # intermediate float copies of the whole set.
    x = torch.empty(sum(len(p[0]) for p in parts), 3, 32, 32)
    start = 0
    for images, _ in parts:
        x[start : start + len(images)] = torch.from_numpy(images)
        start += len(images)
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return x.div_(255.0), y


@register("cifar10")
def load_cifar10(data_path: Path | None, seed: int) -> Dataset:
    """50k train / 10k test, (N, 3, 32, 32), per-channel normalised with train statistics."""
    del seed
    folder = batches_folder(data_path)
    train_x, train_y = _read_split(folder, TRAIN_BATCHES)
    test_x, test_y = _read_split(folder, (TEST_BATCH,))
    mean, std = channel_stats(train_x, per_channel=True)
    return Dataset(
        name="cifar10",
        train_x=normalise_(train_x, mean, std),
        train_y=train_y,
        test_x=normalise_(test_x, mean, std),
        test_y=test_y,
        num_classes=NUM_CLASSES,
        augment=crop_and_flip,
    )
