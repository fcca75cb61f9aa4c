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

    A run resumed at another size continues the stream (:meth:`continue_at`): from the step it resumes
    at, global batches of the new size follow the samples consumed before, none skipped or seen twice.
    A global batch that ``n`` does not divide is cut into slices one sample apart (the first
    ``global % n`` ranks take one more): :attr:`loss_weight` makes their mean gradient exact.

    >>> s = GlobalBatchSampler(num_samples=10, batch_size=2, rank=1, world_size=2, seed=0)
    >>> s.indices(0).shape
    torch.Size([2])
    >>> s.continue_at(step=3, offset=12, global_batch=4, world_size=3); s.batch_size, s.position(3)
    (1, 12)
    """

    def __init__(self, num_samples: int | None, batch_size: int, rank: int, world_size: int, seed: int):
        """``num_samples``: the data set's length; None for a stream (an ``IterableDataset``), whose
        positions alone count (:meth:`span`): no permutation of it is drawn."""
        assert 0 <= rank < world_size and batch_size > 0 and (num_samples is None or num_samples > 0)
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.global_batch_size = batch_size * world_size
        # The stream's origin: ``offset`` samples were consumed before step ``start_step``.
        self.start_step, self.offset = 0, 0
        self._perms: dict[int, torch.Tensor] = {}

    def continue_at(self, step: int, offset: int, global_batch: int, world_size: int | None = None) -> None:
        """From ``step`` on, global batches of ``global_batch`` samples follow the ``offset`` samples
        consumed before it, cut over ``world_size`` ranks (this sampler's if not given)."""
        self.world_size = world_size or self.world_size
        assert global_batch >= self.world_size > self.rank, "a slice for every rank"
        self.start_step, self.offset, self.global_batch_size = step, offset, global_batch

    @property
    def batch_size(self) -> int:
        """This rank's slice of the global batch."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        return base + (self.rank < extra)

    @property
    def loss_weight(self) -> float:
        """What this rank's mean loss is scaled by so that the ranks' mean gradient is the global batch's
        mean: 1 for even slices, ``slice * n / global`` for uneven ones."""
        return self.batch_size * self.world_size / self.global_batch_size

    def position(self, step: int) -> int:
        """Samples of the stream consumed before ``step`` (every rank's)."""
        return self.offset + (step - self.start_step) * self.global_batch_size

    def state(self, step: int) -> dict[str, int]:
        """What a resume at any size needs to continue the stream at ``step``."""
        return {
            "offset": self.position(step),
            "global_batch": self.global_batch_size,
            "ranks": self.world_size,
        }

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_samples, generator=g)
        return self._perms[epoch]

    def epoch_of(self, step: int) -> float:
        assert self.num_samples is not None, "a stream has no epochs of known length"
        return self.position(step) / self.num_samples

    def span(self, step: int) -> tuple[int, int]:
        """This rank's slice of ``step``'s global batch: ``[start, stop)`` positions in the stream."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        start = self.position(step) + self.rank * base + min(self.rank, extra)
        return start, start + self.batch_size

    def indices(self, step: int) -> torch.Tensor:
        assert self.num_samples is not None, "a stream is read in order: span(), not indices()"
        start = self.span(step)[0]
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
