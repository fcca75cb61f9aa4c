"""L-BFGS on flat tensors: the two-loop recursion, and one iteration with or without a line search.

Written for Sandblaster's coordinator, where every function evaluation is a distributed pass over
the batch, so ``evaluate(w) -> (f, g)`` is a callable and nothing here knows about processes.
The conventions follow ``torch.optim.LBFGS`` (initial Hessian ``y's / y'y``, pairs kept only when
``y's > 1e-10``, first step ``min(1, 1/|g|_1) * lr``), so without a line search the iterates are
torch's; the line search is backtracking to the Armijo condition with safeguarded quadratic
interpolation.

>>> import torch
>>> hist = LBFGSHistory(history_size=5)
>>> f = lambda w: (float((w**2).sum()), 2 * w)
>>> w = torch.tensor([3.0, -4.0]); fw, g = f(w)
>>> for i in range(3):
...     w, fw, g, t, n = lbfgs_iteration(f, w, fw, g, hist, lr=1.0, first=(i == 0))
>>> fw < 1e-10
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Evaluate = Callable[[torch.Tensor], tuple[float, torch.Tensor]]
CURVATURE_EPS = 1e-10  # torch.optim.LBFGS's threshold for keeping a pair


class LBFGSHistory:
    """The last ``history_size`` curvature pairs ``(s, y)`` and the two-loop recursion over them."""

    def __init__(self, history_size: int = 10):
        self.history_size = history_size
        self.s: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []
        self.rho: list[float] = []
        self.h_diag = 1.0

    def __len__(self) -> int:
        return len(self.s)

    def update(self, s: torch.Tensor, y: torch.Tensor) -> bool:
        """Keep the pair if it has positive curvature (``y's > 1e-10``); returns whether it was kept."""
        ys = float(y.dot(s))
        if ys <= CURVATURE_EPS:
            return False
        if len(self.s) == self.history_size:
            self.s.pop(0), self.y.pop(0), self.rho.pop(0)
        self.s.append(s.clone())
        self.y.append(y.clone())
        self.rho.append(1.0 / ys)
        self.h_diag = ys / float(y.dot(y))
        return True

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        """``-H g`` by the two-loop recursion; ``-g`` while the history is empty."""
        q = g.neg()
        alpha = [0.0] * len(self.s)
        for i in reversed(range(len(self.s))):
            alpha[i] = float(self.s[i].dot(q)) * self.rho[i]
            q.add_(self.y[i], alpha=-alpha[i])
        r = q.mul_(self.h_diag)
        for i in range(len(self.s)):
            beta = float(self.y[i].dot(r)) * self.rho[i]
            r.add_(self.s[i], alpha=alpha[i] - beta)
        return r

    def reset(self) -> None:
        self.s, self.y, self.rho, self.h_diag = [], [], [], 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"s": list(self.s), "y": list(self.y), "rho": list(self.rho), "h_diag": self.h_diag}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s, self.y = list(state["s"]), list(state["y"])
        self.rho, self.h_diag = [float(r) for r in state["rho"]], float(state["h_diag"])


@dataclass
class LineSearch:
    kind: str = "armijo"  # "armijo" | "none"
    c1: float = 1e-4  # sufficient decrease
    max_evals: int = 10
    tolerance_grad: float = 1e-7  # converged: no step once every |g_i| is below this (torch's default)


def lbfgs_iteration(
    evaluate: Evaluate,
    w: torch.Tensor,
    f: float,
    g: torch.Tensor,
    history: LBFGSHistory,
    lr: float = 1.0,
    first: bool = False,
    line_search: LineSearch | None = None,
) -> tuple[torch.Tensor, float, torch.Tensor, float, int]:
    """One L-BFGS iteration from ``w`` (where ``f, g`` are known): ``(w, f, g, step length, evaluations)``.

    At a stationary point (every ``|g_i| <= tolerance_grad``) nothing is evaluated and ``w`` stays.
    Without a line search the step is taken as it is (one evaluation). With the Armijo search the
    step shrinks until ``f(w + t d) <= f + c1 t g'd``; if no length within ``max_evals`` decreases
    ``f``, the iterate stays and the history is dropped (the next direction is steepest descent).
    """
    ls = line_search or LineSearch("none")
    if float(g.abs().max()) <= ls.tolerance_grad:
        return w, f, g, 0.0, 0
    d = history.direction(g)
    gtd = float(g.dot(d))
    if gtd >= 0:  # not a descent direction (stale curvature): start over from steepest descent
        history.reset()
        d, gtd = g.neg(), -float(g.dot(g))
    t = min(1.0, 1.0 / float(g.abs().sum())) * lr if first else lr
    evals = 0
    while True:
        f_new, g_new = evaluate(w + t * d)
        evals += 1
        if ls.kind == "none" or f_new <= f + ls.c1 * t * gtd:
            break
        if evals >= ls.max_evals:
            if f_new < f:
                break
            history.reset()
            return w, f, g, 0.0, evals
        t = _shrink(t, f, gtd, f_new)
    s = d.mul(t)  # as torch forms it, so iterates match without a line search
    history.update(s, g_new - g)
    return w + s, f_new, g_new, t, evals


def _shrink(t: float, f: float, gtd: float, f_new: float) -> float:
    """Minimiser of the quadratic through f(0), f'(0) and f(t), kept within [0.1 t, 0.5 t]."""
    curvature = f_new - f - gtd * t
    t_quad = -gtd * t * t / (2.0 * curvature) if curvature > 0 else 0.5 * t
    return min(max(t_quad, 0.1 * t), 0.5 * t)
