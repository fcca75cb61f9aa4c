"""L-BFGS as vector operations on shards: DistBelief's point, only scalars travel to the coordinator.

The parameter vector and every L-BFGS vector (the iterate ``w``, the gradient ``g``, the direction
``d``, the trial point and its gradient, the history pairs ``s_i, y_i``) are cut into shards, one per
shard holder (``shard_range``). The coordinator never holds a vector: it runs the iteration of
``lbfgs.py`` as a sequence of operations on named vectors (slots), sent to every holder:
``axpby`` (``c := alpha a + beta b``: copies, scaling and axpy in one), and the reductions ``dot``,
``amax``, ``asum``, whose per-shard results (one float each) are all that comes back. The
coordinator keeps the scalars: ``rho_i``, the initial Hessian scale, which slots hold which pair.

:func:`sharded_lbfgs_iteration` mirrors :func:`~parambox.strategies.sandblaster.lbfgs.lbfgs_iteration`
operation for operation (same formulas, same order), so the iterates are the same up to the order
in which a dot product's shard sums are added. ``Ops`` is the interface the coordinator talks to;
:class:`LocalOps` runs it on shards in one process (tests, one holder).

>>> import torch
>>> from parambox.strategies.sandblaster.lbfgs import LineSearch
>>> target = torch.tensor([3.0, -4.0, 1.0])
>>> def evaluate(w): return float(((w - target) ** 2).sum()), 2 * (w - target)
>>> ops = LocalOps(torch.zeros(3), evaluate, num_shards=2)
>>> hist = ShardedHistory(history_size=5)
>>> f = ops.evaluate(W, G)
>>> for i in range(3):
...     f, t, n = sharded_lbfgs_iteration(ops, f, hist, lr=1.0, first=(i == 0), line_search=LineSearch())
>>> f < 1e-10
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from parambox.box.layout import shard_range
from parambox.strategies.sandblaster.lbfgs import CURVATURE_EPS, LineSearch, _shrink

W, G, D, WT, GT = 0, 1, 2, 3, 4  # slots: iterate, its gradient, direction, trial point, its gradient
FIRST_PAIR = 5  # pair j: s in slot FIRST_PAIR + 2 j, y in the next


def s_slot(j: int) -> int:
    return FIRST_PAIR + 2 * j


def y_slot(j: int) -> int:
    return FIRST_PAIR + 2 * j + 1


def num_slots(history_size: int) -> int:
    """Slots a holder keeps: five vectors and ``history_size + 1`` pairs (one spare for the candidate)."""
    return FIRST_PAIR + 2 * (history_size + 1)


class Ops(Protocol):
    """What the coordinator asks of the shard holders (every call: the same operation on every shard)."""

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None: ...
    def dot(self, a: int, b: int) -> float: ...
    def amax(self, a: int) -> float: ...
    def asum(self, a: int) -> float: ...
    def evaluate(self, src: int, dst: int) -> float:
        """The objective at the vector in ``src``; its gradient lands in ``dst`` (on the shards)."""
        ...


class ShardStore:
    """One holder's shard ``[start, stop)`` of every slot, and the operations on it."""

    def __init__(self, start: int, stop: int, slots: int):
        self.start, self.stop = start, stop
        self.v = torch.zeros(slots, stop - start)

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None:
        # As torch writes the L-BFGS updates: a * alpha, then add_(b, alpha=beta) (so the values are
        # those of lbfgs.py); beta 0 is a copy or a scaling, never 0 * b (b may hold anything).
        out = self.v[a] * alpha if alpha != 1.0 else self.v[a].clone()
        if beta != 0.0:
            out.add_(self.v[b], alpha=beta)
        self.v[c].copy_(out)

    def dot(self, a: int, b: int) -> float:
        return float(self.v[a].double().dot(self.v[b].double()))

    def amax(self, a: int) -> float:
        return float(self.v[a].abs().max()) if self.v.shape[1] else 0.0

    def asum(self, a: int) -> float:
        return float(self.v[a].double().abs().sum())

    def reduce(self, op: str, a: int, b: int) -> float:
        return self.dot(a, b) if op == "dot" else self.amax(a) if op == "amax" else self.asum(a)

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "stop": self.stop, "v": self.v.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["start"], state["stop"]) != (self.start, self.stop) or state["v"].shape != self.v.shape:
            raise ValueError("sandblaster: the checkpoint's shards do not match this run's")
        self.v.copy_(state["v"])


class LocalOps:
    """:class:`Ops` on ``num_shards`` shards in this process; ``evaluate(w) -> (f, g)`` on full vectors."""

    def __init__(
        self,
        w0: torch.Tensor,
        evaluate: Callable[[torch.Tensor], tuple[float, torch.Tensor]],
        num_shards: int = 1,
        history_size: int = 10,
    ):
        n = w0.numel()
        self.shards = [
            ShardStore(*shard_range(n, k, num_shards), num_slots(history_size)) for k in range(num_shards)
        ]
        self.scatter(W, w0)
        self.fn = evaluate

    def scatter(self, slot: int, full: torch.Tensor) -> None:
        for s in self.shards:
            s.v[slot].copy_(full[s.start : s.stop])

    def gather(self, slot: int) -> torch.Tensor:
        return torch.cat([s.v[slot] for s in self.shards])

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None:
        for s in self.shards:
            s.axpby(c, alpha, a, beta, b)

    def dot(self, a: int, b: int) -> float:
        return sum(s.dot(a, b) for s in self.shards)

    def amax(self, a: int) -> float:
        return max(s.amax(a) for s in self.shards)

    def asum(self, a: int) -> float:
        return sum(s.asum(a) for s in self.shards)

    def evaluate(self, src: int, dst: int) -> float:
        f, g = self.fn(self.gather(src))
        self.scatter(dst, g)
        return f


class ShardedHistory:
    """The coordinator's side of the history: which pair slots hold ``(s_i, y_i)``, oldest first, and
    the scalars ``rho_i`` and ``h_diag`` (the vectors stay on the shards)."""

    def __init__(self, history_size: int = 10):
        self.history_size = history_size
        self.pairs: list[int] = []
        self.rho: list[float] = []
        self.h_diag = 1.0

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def spare(self) -> int:
        """A pair index not in use (there are ``history_size + 1``)."""
        return min(set(range(self.history_size + 1)) - set(self.pairs))

    def update(self, ops: Ops, j: int) -> bool:
        """Keep pair ``j`` (already written) if ``y's > 1e-10``, as :meth:`LBFGSHistory.update`."""
        ys = ops.dot(y_slot(j), s_slot(j))
        if ys <= CURVATURE_EPS:
            return False
        if len(self.pairs) == self.history_size:
            self.pairs.pop(0), self.rho.pop(0)
        self.pairs.append(j)
        self.rho.append(1.0 / ys)
        self.h_diag = ys / ops.dot(y_slot(j), y_slot(j))
        return True

    def direction(self, ops: Ops) -> None:
        """``D := -H G`` by the two-loop recursion (``-G`` while the history is empty)."""
        ops.axpby(D, -1.0, G, 0.0, G)
        alpha = [0.0] * len(self.pairs)
        for i in reversed(range(len(self.pairs))):
            j = self.pairs[i]
            alpha[i] = ops.dot(s_slot(j), D) * self.rho[i]
            ops.axpby(D, 1.0, D, -alpha[i], y_slot(j))
        ops.axpby(D, self.h_diag, D, 0.0, D)
        for i, j in enumerate(self.pairs):
            beta = ops.dot(y_slot(j), D) * self.rho[i]
            ops.axpby(D, 1.0, D, alpha[i] - beta, s_slot(j))

    def reset(self) -> None:
        self.pairs, self.rho, self.h_diag = [], [], 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"pairs": list(self.pairs), "rho": list(self.rho), "h_diag": self.h_diag}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs = [int(j) for j in state["pairs"]]
        self.rho, self.h_diag = [float(r) for r in state["rho"]], float(state["h_diag"])


def sharded_lbfgs_iteration(
    ops: Ops,
    f: float,
    history: ShardedHistory,
    lr: float = 1.0,
    first: bool = False,
    line_search: LineSearch | None = None,
) -> tuple[float, float, int]:
    """One L-BFGS iteration from ``W`` (``G`` its gradient, ``f`` its objective): ``(f, step length,
    evaluations)``; afterwards ``W``, ``G`` hold the new iterate and gradient. As ``lbfgs_iteration``."""
    ls = line_search or LineSearch("none")
    if ops.amax(G) <= ls.tolerance_grad:
        return f, 0.0, 0
    history.direction(ops)
    gtd = ops.dot(G, D)
    if gtd >= 0:  # not a descent direction (stale curvature): start over from steepest descent
        history.reset()
        ops.axpby(D, -1.0, G, 0.0, G)
        gtd = -ops.dot(G, G)
    t = min(1.0, 1.0 / ops.asum(G)) * lr if first else lr
    evals = 0
    while True:
        ops.axpby(WT, 1.0, W, t, D)  # w + t d
        f_new = ops.evaluate(WT, GT)
        evals += 1
        if ls.kind == "none" or f_new <= f + ls.c1 * t * gtd:
            break
        if evals >= ls.max_evals:
            if f_new < f:
                break
            history.reset()
            return f, 0.0, evals
        t = _shrink(t, f, gtd, f_new)
    j = history.spare
    ops.axpby(s_slot(j), t, D, 0.0, D)  # s = d t
    ops.axpby(y_slot(j), 1.0, GT, -1.0, G)  # y = g_new - g
    history.update(ops, j)
    ops.axpby(W, 1.0, WT, 0.0, WT)  # w + s: the trial point, as evaluated
    ops.axpby(G, 1.0, GT, 0.0, GT)
    return f_new, t, evals
