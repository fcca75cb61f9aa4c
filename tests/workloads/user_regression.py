"""A user's workload, as a user would write it: non-Sequential models (a skip connection, tied
embeddings), numpy data in TensorDatasets, a custom loss and metrics, and functions that go wrong
(for the bad-input tests). Also a script: ``python user_regression.py STRATEGY WORKERS BATCH OUT
[tied] [rma]`` trains with ``parambox.train`` (and so runs unchanged under torchrun and mpiexec)."""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import parambox

VOCAB, DIM, CONTEXT = 16, 8, 6


class Net(nn.Module):
    """Regression with a skip connection around a block and a head: not an nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.block(h))
        return self.head(h)


class TiedNet(nn.Module):
    """A tiny next-token model whose output layer is its input embedding (tied weights)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.emb(tokens))))


def make_model():
    return Net()


def make_tied():
    return TiedNet()


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32) + 0.1 * np.sin(3 * x[:, 0]))[:, None]
    train = TensorDataset(torch.from_numpy(x[:256]), torch.from_numpy(y[:256]))
    test = TensorDataset(torch.from_numpy(x[256:]), torch.from_numpy(y[256:]))
    return train, test


def make_tokens():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (160, CONTEXT + 1), generator=g)
    seq[:, 1::2] = (seq[:, 0::2][:, : seq[:, 1::2].shape[1]] + 1) % VOCAB  # learnable: odd = even + 1
    train = TensorDataset(seq[:128, :-1], seq[:128, 1:])
    return train, TensorDataset(seq[128:, :-1], seq[128:, 1:])


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def token_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def regression_metrics(model, batch):
    x, y = batch
    err = model(x) - y
    return {"mse": float((err**2).mean()), "mae": float(err.abs().mean())}


# -- functions that go wrong ----------------------------------------------------------------------


def model_raises():
    raise RuntimeError("no GPU memory left (pretend)")


def model_wrong_type():
    return "not a module"


def loss_vector(model, batch):
    x, y = batch
    return (model(x) - y) ** 2


def loss_nan(model, batch):
    return mse(model, batch) * float("nan")


class Ragged(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.zeros(4 + i % 2), torch.zeros(1)


def data_ragged():
    return Ragged(), None


if __name__ == "__main__":
    strategy, workers, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tied, box = "tied" in sys.argv[5:], "rma" if "rma" in sys.argv[5:] else "shm"
    parambox.train(
        model=make_tied if tied else make_model,
        data=make_tokens if tied else make_data,
        loss=token_loss if tied else mse,
        strategy=strategy,
        workers=workers,
        steps=20,
        batch_size=batch,
        lr=0.1,
        momentum=0.0,
        eval_every=0,
        threads=1,
        progress=False,
        out=out,
        box=box,
    )


# -- dict items with named model inputs (a Hugging Face-style forward(**batch)) ---------------------


class NamedInputsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, features, scale):
        return self.lin(features) * scale


class DictItems(Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x, self.s = torch.randn(n, 4, generator=g), torch.rand(n, 1, generator=g) + 0.5
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "scale": self.s[i], "label": self.y[i]}


def make_named_model():
    return NamedInputsNet()


def make_dict_items():
    return DictItems(128, 0), DictItems(32, 1)


def named_inputs_loss(model, batch):
    pred = model(features=batch["features"], scale=batch["scale"])
    return ((pred - batch["label"]) ** 2).mean()


class _DictItems(torch.utils.data.Dataset):
    """Items as dicts (``{"x": ..., "target": ...}``), as many user data sets give them."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return {"x": x, "target": y}


def make_dict_data():
    train, test = make_data()
    return _DictItems(train), _DictItems(test)


def loss_vector_on_rank0(model, batch):
    """A user error on rank 0 alone, on the first step: the other ranks are already in the first
    gradient exchange, waiting for it."""
    import os

    return loss_vector(model, batch) if os.environ.get("RANK") == "0" else mse(model, batch)
