"""L-BFGS as vector operations on shards: DistBelief's point, only scalars travel to the coordinator.

The parameter vector and every L-BFGS vector (the iterate ``w``, the gradient ``g``, the direction
``d``, the trial point and its gradient, the history pairs ``s_i, y_i``) are cut into shards, one per
shard holder (``shard_range``). The coordinator never holds a vector: it runs the iteration of
``lbfgs.py`` as operations on named vectors (slots), sent to every holder: ``axpby`` (``c := alpha a
+ beta b``: copies, scaling and axpy in one), ``lincomb`` (a combination of many), and ``reduce``
(a block of dot products and ``max |v|``, ``sum |v|``), whose per-shard sums are all that comes back.

The two-loop recursion is vector-free (Chen, Wang and Zhou, NeurIPS 2014; :class:`Gram`): the
coordinator keeps the dot products among the gradient and the pairs, runs the recursion on the
direction's coefficients over them, and sends one ``lincomb``. With the iterate among those
products, the weight-decay term of every trial point comes from scalars too, so the holders are
asked once per iteration, where the recursion over the shards asked 2m + 6 times and once more per
evaluation, each a round trip. The iterates are
:func:`~parambox.strategies.sandblaster.lbfgs.lbfgs_iteration`'s up to float rounding (the
combination is summed in float64). ``Ops`` is the interface the coordinator talks to;
:class:`LocalOps` runs it on shards in one process (tests, one holder).

>>> import torch
>>> from parambox.strategies.sandblaster.lbfgs import LineSearch
>>> target = torch.tensor([3.0, -4.0, 1.0])
>>> def evaluate(w): return float(((w - target) ** 2).sum()), 2 * (w - target)
>>> ops = Gram(LocalOps(torch.zeros(3), evaluate, num_shards=2))
>>> hist = ShardedHistory(history_size=5)
>>> f = ops.objective_at_w()
>>> for i in range(3):
...     f, t, n = sharded_lbfgs_iteration(ops, f, hist, lr=1.0, first=(i == 0), line_search=LineSearch())
>>> f < 1e-10
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

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
    def lincomb(self, c: int, terms: dict[int, float]) -> None:
        """``c := sum(coef * slot)`` over ``terms = {slot: coef}``, summed in float64."""
        ...

    def reduce(self, rows: list[int], cols: list[int], amax: int = -1, asum: int = -1) -> Reduced:
        """Every dot product ``rows[i] . cols[j]``, and ``max |v|`` / ``sum |v|`` of the slots ``amax``
        / ``asum`` (-1: none), over the whole vectors: one answer per holder, whatever is asked."""
        ...

    weight_decay: float  # the objective's quadratic term: 0.5 * weight_decay * |w|^2

    def evaluate(self, src: int, dst: int) -> float:
        """The objective at the vector in ``src`` without its weight-decay term (which the caller adds
        from the dot products); its whole gradient, the decay's included, lands in ``dst``."""
        ...


class Reduced(NamedTuple):
    dots: torch.Tensor  # float64, rows x cols
    amax: float
    asum: float


def reply_length(rows: list[int], cols: list[int]) -> int:
    """Floats in one holder's answer to :meth:`ShardStore.reduce`."""
    return len(rows) * len(cols) + 2


def combine(replies: list[torch.Tensor], rows: list[int], cols: list[int]) -> Reduced:
    """The holders' answers as the whole vectors' (dot products and sums add up, maxima take the max)."""
    stacked = torch.stack(replies)
    n = len(rows) * len(cols)
    dots = stacked[:, :n].sum(0).view(len(rows), len(cols))
    return Reduced(dots, float(stacked[:, n].max()), float(stacked[:, n + 1].sum()))


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

    def lincomb(self, c: int, terms: dict[int, float]) -> None:
        out = torch.zeros(self.v.shape[1], dtype=torch.float64)
        for slot, coef in terms.items():
            out.add_(self.v[slot].double(), alpha=coef)
        self.v[c].copy_(out)

    def reduce(self, rows: list[int], cols: list[int], amax: int = -1, asum: int = -1) -> torch.Tensor:
        """This shard's part of :meth:`Ops.reduce`, ``reply_length`` float64: the dot products row by row,
        then ``max |v|`` and ``sum |v|`` (0 where not asked)."""
        # Every slot against each row, in the vectors' own precision (as torch.optim.LBFGS takes its
        # dot products): no copy of the slots, whose allocation cost more than the products.
        v = self.v
        out = torch.zeros(reply_length(rows, cols), dtype=torch.float64)
        for i, a in enumerate(rows):
            out[i * len(cols) : (i + 1) * len(cols)] = torch.mv(v, v[a])[cols]
        if amax >= 0 and v.shape[1]:
            out[-2] = v[amax].abs().max()
        if asum >= 0:
            out[-1] = v[asum].abs().sum()
        return out

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
        weight_decay: float = 0.0,
    ):
        n = w0.numel()
        self.weight_decay = weight_decay
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

    def lincomb(self, c: int, terms: dict[int, float]) -> None:
        for s in self.shards:
            s.lincomb(c, terms)

    def reduce(self, rows: list[int], cols: list[int], amax: int = -1, asum: int = -1) -> Reduced:
        return combine([s.reduce(rows, cols, amax, asum) for s in self.shards], rows, cols)

    def evaluate(self, src: int, dst: int) -> float:
        w = self.gather(src)
        f, g = self.fn(w)
        self.scatter(dst, g + self.weight_decay * w)
        return f


class Gram:
    """The holders' operations, with the dot products among slots kept at the coordinator.

    Vector-free L-BFGS (Chen, Wang and Zhou, NeurIPS 2014): the two-loop recursion needs nothing but
    the dot products among the gradient and the history pairs, so the coordinator keeps those scalars
    and runs the recursion on the coefficients of the direction over them; the holders then form the
    direction as one linear combination. Each iteration asks the holders once, for the new vectors'
    products with the rest (``fill``), where the recursion over the shards asked 2m + 6 times in turn.
    Writing a slot (through this object) drops its products.
    """

    def __init__(self, ops: Ops):
        self.ops = ops
        self.dots: dict[int, dict[int, float]] = {}  # a -> {b: a . b}, both ways
        self.norms: dict[tuple[str, int], float] = {}  # ("amax" | "asum", slot)

    def written(self, slot: int) -> None:
        for b in self.dots.pop(slot, {}):
            self.dots.get(b, {}).pop(slot, None)
        self.norms.pop(("amax", slot), None)
        self.norms.pop(("asum", slot), None)

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None:
        self.written(c)
        self.ops.axpby(c, alpha, a, beta, b)

    def lincomb(self, c: int, terms: dict[int, float]) -> None:
        self.written(c)
        self.ops.lincomb(c, terms)

    def evaluate(self, src: int, dst: int) -> float:
        self.written(dst)
        return self.ops.evaluate(src, dst)

    def dot(self, a: int, b: int) -> float:
        return self.dots[a][b]

    def along(self, slot: int, terms: dict[int, float]) -> float:
        """``slot . sum(coef * k)`` over ``terms = {k: coef}``, from the products."""
        return sum(c * self.dot(slot, k) for k, c in terms.items())

    def square(self, terms: dict[int, float]) -> float:
        """``|sum(coef * k)|^2``, from the products."""
        return sum(c * self.along(k, terms) for k, c in terms.items())

    def objective_at_w(self) -> float:
        """Evaluate at ``W`` (its gradient into ``G``): the objective, its weight-decay term included."""
        f = self.evaluate(W, G)
        self.fill([W])
        return f + 0.5 * self.ops.weight_decay * self.dot(W, W)

    def fill(self, basis: list[int], amax: int = -1, asum: int = -1) -> None:
        """Every product among ``basis`` (and ``max |amax|``, ``sum |asum|``) not yet known: one request."""
        rows = [a for a in basis if any(b not in self.dots.get(a, ()) for b in basis)]
        amax = amax if amax >= 0 and ("amax", amax) not in self.norms else -1
        asum = asum if asum >= 0 and ("asum", asum) not in self.norms else -1
        if not rows and amax < 0 and asum < 0:
            return
        cols = basis if rows else []
        got = self.ops.reduce(rows, cols, amax, asum)
        for a, values in zip(rows, got.dots.tolist()):
            for b, v in zip(cols, values):
                self.dots.setdefault(a, {})[b] = v
                self.dots.setdefault(b, {})[a] = v
        if amax >= 0:
            self.norms["amax", amax] = got.amax
        if asum >= 0:
            self.norms["asum", asum] = got.asum


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

    def basis(self) -> list[int]:
        """The slots the direction is a combination of: the gradient and every pair's ``s``, ``y``."""
        return [G] + [s_slot(j) for j in self.pairs] + [y_slot(j) for j in self.pairs]

    def update(self, gram: Gram, j: int) -> bool:
        """Keep pair ``j`` (written, its products filled) if ``y's > 1e-10``, as :meth:`LBFGSHistory.update`."""
        ys = gram.dot(y_slot(j), s_slot(j))
        if ys <= CURVATURE_EPS:
            return False
        if len(self.pairs) == self.history_size:
            self.pairs.pop(0), self.rho.pop(0)
        self.pairs.append(j)
        self.rho.append(1.0 / ys)
        self.h_diag = ys / gram.dot(y_slot(j), y_slot(j))
        return True

    def direction(self, gram: Gram) -> dict[int, float]:
        """``-H G`` as coefficients over :meth:`basis` (``{G: -1}`` while the history is empty): the
        two-loop recursion of :meth:`LBFGSHistory.direction`, run on the products (filled)."""
        delta = {G: -1.0}
        alpha = [0.0] * len(self.pairs)
        for i in reversed(range(len(self.pairs))):
            j = self.pairs[i]
            alpha[i] = gram.along(s_slot(j), delta) * self.rho[i]
            delta[y_slot(j)] = delta.get(y_slot(j), 0.0) - alpha[i]
        delta = {k: c * self.h_diag for k, c in delta.items()}
        for i, j in enumerate(self.pairs):
            beta = gram.along(y_slot(j), delta) * self.rho[i]
            delta[s_slot(j)] = delta.get(s_slot(j), 0.0) + alpha[i] - beta
        return delta

    def reset(self) -> None:
        self.pairs, self.rho, self.h_diag = [], [], 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"pairs": list(self.pairs), "rho": list(self.rho), "h_diag": self.h_diag}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs = [int(j) for j in state["pairs"]]
        self.rho, self.h_diag = [float(r) for r in state["rho"]], float(state["h_diag"])


def sharded_lbfgs_iteration(
    gram: Gram,
    f: float,
    history: ShardedHistory,
    lr: float = 1.0,
    first: bool = False,
    line_search: LineSearch | None = None,
) -> tuple[float, float, int]:
    """One L-BFGS iteration from ``W`` (``G`` its gradient, ``f`` its objective): ``(f, step length,
    evaluations)``; afterwards ``W``, ``G`` hold the new iterate and gradient. As ``lbfgs_iteration``;
    the holders are asked for scalars once per iteration, whatever the line search does."""
    ls = line_search or LineSearch("none")
    gram.fill(history.basis() + [W], amax=G, asum=G if first else -1)  # known already after an iteration
    if gram.norms["amax", G] <= ls.tolerance_grad:
        return f, 0.0, 0
    delta = history.direction(gram)
    gtd = gram.along(G, delta)
    if gtd >= 0:  # not a descent direction (stale curvature): start over from steepest descent
        history.reset()
        delta = {G: -1.0}
        gtd = gram.along(G, delta)
    gram.lincomb(D, delta)
    # |w + t d|^2 for the weight-decay term, from the products: no reduction per evaluation.
    ww, wd, dd = gram.dot(W, W), gram.along(W, delta), gram.square(delta)
    t = min(1.0, 1.0 / gram.norms["asum", G]) * lr if first else lr
    evals = 0
    while True:
        gram.axpby(WT, 1.0, W, t, D)  # w + t d
        f_new = gram.evaluate(WT, GT) + 0.5 * gram.ops.weight_decay * (ww + 2 * t * wd + t * t * dd)
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
    gram.axpby(s_slot(j), t, D, 0.0, D)  # s = d t
    gram.axpby(y_slot(j), 1.0, GT, -1.0, G)  # y = g_new - g
    gram.axpby(W, 1.0, WT, 0.0, WT)  # w + s: the trial point, as evaluated
    gram.axpby(G, 1.0, GT, 0.0, GT)
    # The next iteration's products (the new iterate's, gradient's and pair's with the rest) and
    # this pair's curvature, in one request.
    gram.fill([G, W, s_slot(j), y_slot(j)] + history.basis()[1:], amax=G)
    history.update(gram, j)
    return f_new, t, evals
