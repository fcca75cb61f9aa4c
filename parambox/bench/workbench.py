"""What ``bench cluster`` trains: a zoo model on fixed batches, every setup the same loss.

The benchmark CNN on random CIFAR-size images by default (the figures of MEASURED.md), or any zoo
model on batches of a registered data set; a sequence model (``gpt`` on ``text``) through
``FlatLogits``, so DDP, the peers and every strategy train ``cross_entropy(model(x), y)`` alike.

>>> Workbench.of("gpt-25m")
Workbench(model='gpt-25m', data='text', batch=8)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parambox.bench.workers import BATCH

SEQUENCE_BATCH = 8  # windows a worker per step for a sequence model: 1,024 tokens of 128 bytes
NUM_BATCHES = 8  # fixed batches per rank, cycled


class FlatLogits(nn.Module):
    """A sequence model whose (B, T, C) logits come out as (B*T, C), so every setup's loss is the plain
    ``cross_entropy(model(x), y)`` against the flattened targets: the mean per position, unchanged."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).flatten(0, -2)


@dataclass(frozen=True)
class Workbench:
    """What every setup trains: zoo model ``model`` on fixed batches of ``batch`` samples a rank from
    data set ``data`` (None: random CIFAR-size images, the figures of MEASURED.md), with the loss
    ``cross_entropy(model(x), y)``. Every setup's model starts from the same seed."""

    model: str = "cnn"
    data: str | None = None
    batch: int = BATCH

    @classmethod
    def of(cls, model: str = "cnn", data: str | None = None, batch: int | None = None) -> Workbench:
        """The model's own data set where it has one (``gpt``: ``text``); a sequence model's batch is
        ``SEQUENCE_BATCH`` windows unless given."""
        from parambox.models.registry import data_for

        data = data or data_for(model)
        sequence = data is not None and _dataset(data).sequence
        return cls(model, data, batch or (SEQUENCE_BATCH if sequence else BATCH))

    def build(self) -> nn.Module:
        from parambox.models import build_model

        shape, classes = ((3, 32, 32), 10) if self.data is None else self._shape()
        torch.manual_seed(0)
        model = build_model(self.model, shape, classes)
        return FlatLogits(model) if self.data is not None and _dataset(self.data).sequence else model

    def _shape(self) -> tuple[tuple[int, ...], int]:
        ds = _dataset(self.data)
        return ds.input_shape, ds.num_classes

    def batches(self, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``NUM_BATCHES`` fixed batches of this rank, different per rank."""
        if self.data is None:
            return self._random(rank)
        ds = _dataset(self.data)
        g = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, len(ds.train_y), (NUM_BATCHES, self.batch), generator=g)
        flat = (lambda y: y.flatten().long()) if ds.sequence else (lambda y: y)
        return [(ds.train_x[i], flat(ds.train_y[i])) for i in idx]

    def _random(self, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # At batch 64: the batches of ``bench.workers.random_batches``, drawn the same way.
        g = torch.Generator().manual_seed(rank)
        return [
            (
                torch.randn(self.batch, 3, 32, 32, generator=g),
                torch.randint(0, 10, (self.batch,), generator=g),
            )
            for _ in range(NUM_BATCHES)
        ]

    def size(self) -> dict[str, Any]:
        """The model's parameters and their float32 megabytes (what one full exchange moves)."""
        n = sum(p.numel() for p in self.build().parameters())
        return {"parameters": n, "model_mb": 4.0 * n / 1e6}

    def args(self) -> list[str]:
        return [self.model, self.data or "-", str(self.batch)]

    @classmethod
    def from_args(cls, model: str, data: str, batch: str) -> Workbench:
        return cls(model, None if data == "-" else data, int(batch))


@functools.cache
def _dataset(name: str):
    from parambox.data import load_dataset

    return load_dataset(name)
