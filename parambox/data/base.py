"""The in-memory data set every loader returns, and the sampler that shards global batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# A train-time augmentation applied to one batch: (x, generator) -> x. Seeded per step and rank,
# so a resumed run sees exactly the batches an uninterrupted one would.
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@dataclass
class Dataset:
    """Train and test tensors already normalised; ``x`` is (N, C, H, W) for images, (N, D) otherwise.

    ``sequence``: ``y`` holds a target per position, (N, T) class indices for a model whose output is
    (N, T, num_classes): the default loss is then the mean cross-entropy per position (``text``).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    augment: Augment | None = None
    sequence: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


class GlobalBatchSampler:
    """Cuts an endless stream of per-epoch permutations into global batches.

    The global batch at step ``t`` depends only on ``(seed, t, global_batch_size)``; data-parallel
    rank ``r`` of ``n`` takes slice ``r`` of it. So a 2-worker run at batch b and a 1-worker run at
    batch 2b see the same samples, and resuming at step ``t`` needs nothing but ``t``.

    >>> s = GlobalBatchSampler(num_samples=10, batch_size=2, rank=1, world_size=2, seed=0)
    >>> s.indices(0).shape
    torch.Size([2])
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int):
        assert 0 <= rank < world_size and batch_size > 0 and num_samples > 0
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_samples, generator=g)
        return self._perms[epoch]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / self.num_samples

    def indices(self, step: int) -> torch.Tensor:
        start = step * self.global_batch_size + self.rank * self.batch_size
        out = []
        pos, need = start, self.batch_size
        while need:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(need, self.num_samples - offset)
            out.append(self._perm(epoch)[offset : offset + take])
            pos, need = pos + take, need - take
        return torch.cat(out)


class BatchSource:
    """Batches for one data-parallel rank: ``batch(step) -> (x, y)``, augmented when the set says so."""

    def __init__(self, ds: Dataset, batch_size: int, rank: int, world_size: int, seed: int, augment: bool):
        self.ds = ds
        self.sampler = GlobalBatchSampler(len(ds.train_y), batch_size, rank, world_size, seed)
        self.augment = ds.augment if augment else None
        self.seed = seed
        self.rank = rank

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.sampler.indices(step)
        x, y = self.ds.train_x[idx], self.ds.train_y[idx]
        if self.augment is not None:
            g = torch.Generator().manual_seed((self.seed * 7919 + step) * 65_537 + self.rank)
            x = self.augment(x, g)
        return x, y

    def close(self) -> None:
        """Nothing to stop: the tensors are in memory (a user's data set's source has loaders)."""
