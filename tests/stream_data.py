"""A user's streaming data set for the stream tests: ``--data tests/stream_data.py:make_data``.

``Numbers`` yields item ``i`` as ``(i, x_i, y_i)`` for ``i`` in ``0..N-1``, a finite pass that a run
reads again and again; ``make_data`` gives it as the training stream and 200 more items as a test
stream, for the ``regression`` model below (4 inputs, 1 output).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import IterableDataset

N = 500


class Numbers(IterableDataset):
    def __init__(self, n: int = N, offset: int = 0):
        self.n, self.offset = n, offset

    def __iter__(self):
        g = torch.Generator().manual_seed(self.offset)
        x = torch.randn(self.n, 4, generator=g)
        y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).tanh()
        for i in range(self.n):
            yield self.offset + i, x[i], y[i]


def make_data():
    return Numbers(), Numbers(200, offset=10_000)


def make_model():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def mse(model, batch):
    _, x, y = batch
    return ((model(x) - y) ** 2).mean()


def make_map_data():
    """The same items as a map-style data set (a permutation an epoch, not the stream's order)."""
    from torch.utils.data import TensorDataset

    def tensors(ds):
        ids, xs, ys = zip(*ds)
        return TensorDataset(torch.tensor(ids), torch.stack(xs), torch.stack(ys))

    return tensors(Numbers()), tensors(Numbers(200, offset=10_000))


def make_model_late_on_rank_2():
    """The model, 3 s late on rank 2: a worker that joins a ``--workers 2:3`` run mid-stream."""
    import os
    import time

    if os.environ.get("RANK") == "2":
        time.sleep(3)
    return make_model()
