"""Sandblaster's dispatch policy: which portion of the batch a free worker computes next.

Pure bookkeeping, no processes, so it is tested on its own. Fresh portions go out in order to
whichever worker asks first (fast workers ask more often, so they take more: load balancing). Once
none is left and backups are on, a worker that asks gets a copy of a portion still running on
another worker (the one started earliest among those with the fewest copies): a *backup task*.
The first result of a portion wins; later copies are dropped.

>>> s = PortionScheduler(2)
>>> s.next_for(1), s.next_for(2)  # two fresh portions
(0, 1)
>>> s.complete(2, 1)
True
>>> s.next_for(2)  # nothing fresh left: a backup of portion 0, still running on worker 1
0
>>> s.complete(2, 0), s.complete(1, 0), s.done, s.backup_wins
(True, False, True, 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parambox.strategies.tensors import map_tensors


class PortionScheduler:
    """Hands out ``num_portions`` portions to workers, with backup copies near the end."""

    def __init__(self, num_portions: int, backup: bool = True, max_copies: int = 2):
        assert num_portions >= 1 and max_copies >= 1
        self.backup = backup
        self.max_copies = max_copies
        self.fresh = list(range(num_portions))
        self.running: dict[int, list[int]] = {}  # portion -> workers computing it now
        self.owner: dict[int, int] = {}  # portion -> the worker it was first handed to
        self.finished: set[int] = set()
        self.num_portions = num_portions
        self.backups = 0  # backup copies handed out
        self.backup_wins = 0  # portions whose first result came from a backup copy

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_portions

    def next_for(self, worker: int) -> int | None:
        """The portion ``worker`` should compute now, or None (nothing it could usefully do)."""
        if self.fresh:
            portion = self.fresh.pop(0)
            self.running[portion] = [worker]
            self.owner[portion] = worker
            return portion
        if not self.backup:
            return None
        candidates = [
            p
            for p, workers in self.running.items()
            if p not in self.finished and worker not in workers and len(workers) < self.max_copies
        ]
        if not candidates:
            return None
        portion = min(candidates, key=lambda p: len(self.running[p]))  # dicts keep start order
        self.running[portion].append(worker)
        self.backups += 1
        return portion

    def complete(self, worker: int, portion: int) -> bool:
        """Record a result; True if it is the portion's first (the one to use)."""
        workers = self.running.get(portion, [])
        if worker in workers:
            workers.remove(worker)
        if portion in self.finished:
            return False
        self.finished.add(portion)
        if worker != self.owner.get(portion):
            self.backup_wins += 1
        return True


def portion_bounds(batch_size: int, num_portions: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the batch cut into ``num_portions`` contiguous, nearly equal portions."""
    sizes = [len(c) for c in torch.arange(batch_size).tensor_split(min(num_portions, batch_size))]
    edges = [0]
    for size in sizes:
        edges.append(edges[-1] + size)
    return list(zip(edges[:-1], edges[1:]))


def compute_portion(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    bounds: tuple[int, int],
    slow_factor: float = 1.0,
    stopped: Callable[[], bool] = lambda: False,
) -> torch.Tensor | None:
    """``[loss sum, samples, seconds, gradient sum...]`` of one portion at the model's weights, on
    the CPU (messages go over gloo, also where the model is on a GPU); None if ``stopped()`` said so
    before the forward pass, before the backward pass or during the slow machine's extra time.

    Sums, not means: portions of different sizes add up to the batch's totals. ``slow_factor > 1``
    computes the portion's gradient again (results dropped) until the portion has taken that many
    times as long: the demo's slow machine, busy as a slow one is, and stopped between passes (the
    part a stop saves).
    """
    start, end = bounds
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    if stopped():
        return None
    for p in params:
        p.grad = None
    portion = map_tensors(lambda t: t[start:end], batch)
    loss = loss_fn(model, portion) * (end - start)
    if stopped():
        return None
    loss.backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    seconds = time.perf_counter() - t0
    while slow_factor > 1.0 and time.perf_counter() - t0 < slow_factor * seconds:
        if stopped():
            return None
        torch.autograd.grad(loss_fn(model, portion), params, allow_unused=True)  # the same work again
    seconds = time.perf_counter() - t0
    if stopped():
        return None
    return torch.cat([torch.tensor([float(loss.detach()), float(end - start), seconds]), grad.detach().cpu()])
