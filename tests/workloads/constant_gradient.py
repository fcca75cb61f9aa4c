"""A workload whose gradient is constant and differs per rank, for closed-form fault tests: the loss of
rank ``r`` (its launch rank, ``RANK``, or Open MPI's rank under mpiexec) is ``2**r * sum(w)``, so its gradient is ``2**r`` everywhere,
whatever the weights and the batch. With plain SGD, N ranks averaging for K steps and then the
survivors for the rest end at a weight that is known exactly."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

DIM = 8


def make_model():
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def make_model_with_buffer():
    """``make_model`` with a float buffer (as batch norm's statistics): the synchronous strategies
    broadcast rank 0's buffers every step, a collective a lost peer can break too."""
    model = make_model()
    model.register_buffer("running", torch.ones(DIM))
    return model


def make_model_slow_to_replace():
    """``make_model``, 3 s slower in a replacement (a later life): a data set or model that takes a
    while to load. The members of a run that survives in place must not wait for it."""
    if os.environ.get("PARAMBOX_LIFE", "0") != "0":
        time.sleep(3.0)
    return make_model()


def make_model_late_on_rank_2():
    """``make_model``, 3 s slower on rank 2: a worker that joins a running job (``workers = "2:3"``) a
    while after the others started."""
    if _rank() == 2:
        time.sleep(3.0)
    return make_model()


def make_layered_model():
    """Three linear layers (six parameters), all zero: with ``loss_of_all`` backward finishes them one
    by one, last to first, each with the constant gradient of ``loss``."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def loss_of_all(model, batch):
    return gradient_of(_rank()) * sum(p.sum() for p in model.parameters())


def make_data():
    x = torch.zeros(256, DIM)
    return TensorDataset(x, torch.zeros(256, 1)), TensorDataset(x[:32], torch.zeros(32, 1))


def gradient_of(rank: int) -> float:
    return float(2**rank)


def _rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0")  # mpiexec: Open MPI's


def loss(model, batch):
    return gradient_of(_rank()) * model.weight.sum()


def metrics(model, batch):
    return {"loss": float(model.weight.sum())}


def closed_form(lr: float, steps: int, ranks: list[int], killed: int, at: int) -> float:
    """Every weight after ``steps`` SGD steps: the mean gradient of ``ranks`` for ``at`` steps, then of
    the survivors (``ranks`` less ``killed``) for the rest."""
    survivors = [r for r in ranks if r != killed]
    full = sum(gradient_of(r) for r in ranks) / len(ranks)
    rest = sum(gradient_of(r) for r in survivors) / len(survivors)
    return -lr * (at * full + (steps - at) * rest)


def weight_after(lr: float, phases: list[tuple[int, list[int]]], momentum: float = 0.0) -> float:
    """Every weight after SGD (torch's momentum form) through ``phases``: (steps, the ranks whose mean
    gradient those steps take)."""
    w, buf = 0.0, None
    for steps, ranks in phases:
        g = sum(gradient_of(r) for r in ranks) / len(ranks)
        for _ in range(steps):
            buf = g if buf is None else momentum * buf + g
            w -= lr * buf
    return w


def diloco_after(
    lr: float, inner_steps: int, phases: list[tuple[int, list[int]]], outer_lr: float, mu: float
) -> float:
    """Every weight after synchronous DiLoCo with inner plain SGD through ``phases``: (rounds, the
    ranks whose mean pseudo-gradient those rounds take); the outer step is torch's Nesterov SGD."""
    w, buf = 0.0, None
    for rounds, ranks in phases:
        delta = inner_steps * lr * sum(gradient_of(r) for r in ranks) / len(ranks)
        for _ in range(rounds):
            buf = delta if buf is None else mu * buf + delta
            w -= outer_lr * (delta + mu * buf)
    return w


def easgd_center_after(
    lr: float, alpha: float, tau: int, steps: int, ranks: list[int], killed: int, at: int
) -> float:
    """The center of synchronous EASGD (local plain SGD, an elastic exchange every ``tau`` steps) after
    ``steps``, ``killed`` taking no part from step ``at`` on: every replica's and the center's moves."""
    x, c = dict.fromkeys(ranks, 0.0), 0.0
    for step in range(steps):
        alive = [r for r in ranks if r != killed or step < at]
        for r in alive:
            x[r] -= lr * gradient_of(r)
        if (step + 1) % tau == 0:
            d = {r: x[r] - c for r in alive}
            for r in alive:
                x[r] -= alpha * d[r]
            c += alpha * sum(d.values())
    return c
