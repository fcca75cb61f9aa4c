"""Speedup and efficiency curves: T_iter(n) = T_comp(b(n)) + T_comm(n) - overlap * min(T_comp, T_comm).

Strong scaling (Keuper & Pfreundt's setting): the global batch B is fixed, each of n workers computes
b = B/n samples, and the speedup is T_iter(1 process, no communication) / T_iter(n). n > B is infeasible
(a worker would get less than one sample) and has no speedup. Weak scaling: each worker keeps b samples,
so n workers process n*b per step and the (scaled) speedup is n * T_comp(b) / T_iter(n).

``overlap`` is the fraction of the communication hidden behind computation (bucketed allreduce overlapped
with backward); it can hide at most the computation's length. Default 0: communication after backward,
as the analysis in the paper (and ``--validate``) assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from parambox.perfmodel.compute import ComputeProfile
from parambox.perfmodel.topology import Network, comm_time_s

DEFAULT_WORKER_COUNTS = [2**k for k in range(11)]  # 1 .. 1024
PEAK_TOLERANCE = 0.01  # a doubling of n that gains less than 1 % speedup counts as no growth


@dataclass
class ScalingCurve:
    """One topology's prediction over worker counts; entries are None where n is infeasible.

    >>> c = ScalingCurve("ring", [1, 2, 4], [1.0, 0.6, 0.55], [1.0, 0.5, 0.25], [0.0, 0.1, 0.3])
    >>> c.speedup, c.n_peak, c.still_growing
    ([1.0, 1.6666666666666667, 1.8181818181818181], 4, True)
    """

    topology: str
    n: list[int]
    t_iter_s: list[float | None]
    t_comp_s: list[float | None]
    t_comm_s: list[float | None]
    baseline_s: float | None = None  # T_iter of one process without communication
    weak: bool = False

    def __post_init__(self):
        if self.baseline_s is None:
            self.baseline_s = self.t_comp_s[self.n.index(1)] if 1 in self.n else self.t_iter_s[0]

    @property
    def speedup(self) -> list[float | None]:
        out = []
        for n, t in zip(self.n, self.t_iter_s):
            out.append(None if t is None else (n if self.weak else 1) * self.baseline_s / t)
        return out

    @property
    def efficiency(self) -> list[float | None]:
        return [None if s is None else s / n for n, s in zip(self.n, self.speedup)]

    @property
    def n_peak(self) -> int:
        """The smallest n whose speedup is within ``PEAK_TOLERANCE`` (1 %) of the best on the grid: more
        workers than this gain (almost) nothing. For a curve with a maximum this is the maximum."""
        feasible = [(n, s) for n, s in zip(self.n, self.speedup) if s is not None]
        best = max(s for _, s in feasible)
        return next(n for n, s in feasible if s * (1 + PEAK_TOLERANCE) >= best)

    @property
    def still_growing(self) -> bool:
        """True when the last doubling of n on the grid still gained more than the tolerance."""
        feasible = [s for s in self.speedup if s is not None]
        return len(feasible) > 1 and feasible[-1] > feasible[-2] * (1 + PEAK_TOLERANCE)

    @property
    def n_efficient(self) -> int | None:
        """The largest n whose parallel efficiency is still at least 50 % (None if even n = 1 is below)."""
        ok = [n for n, e in zip(self.n, self.efficiency) if e is not None and e >= 0.5]
        return max(ok) if ok else None

    def as_json(self) -> dict:
        def ms(xs):
            return [None if x is None else x * 1e3 for x in xs]

        return {
            "n": self.n,
            "t_iter_ms": ms(self.t_iter_s),
            "t_comp_ms": ms(self.t_comp_s),
            "t_comm_ms": ms(self.t_comm_s),
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "n_peak": self.n_peak,
            "peak_speedup": max(s for s in self.speedup if s is not None),
            "still_growing": self.still_growing,
            "n_efficient": self.n_efficient,
        }


def iteration_time_s(t_comp: float, t_comm: float, overlap: float) -> float:
    assert 0.0 <= overlap <= 1.0
    return t_comp + t_comm - overlap * min(t_comp, t_comm)


def predict_curve(
    topology: str,
    compute: ComputeProfile,
    size_bytes: float,
    net: Network,
    batch: int,
    weak: bool = False,
    overlap: float = 0.0,
    worker_counts: list[int] = DEFAULT_WORKER_COUNTS,
) -> ScalingCurve:
    """``batch`` is the global batch (strong) or the per-worker batch (weak)."""
    t_iter, t_comp, t_comm = [], [], []
    for n in worker_counts:
        local = batch if weak else batch / n
        if local < 1:
            t_iter.append(None), t_comp.append(None), t_comm.append(None)
            continue
        tc = compute.time_s(local)
        tm = comm_time_s(topology, n, size_bytes, net)
        t_iter.append(iteration_time_s(tc, tm, overlap))
        t_comp.append(tc)
        t_comm.append(tm)
    baseline = compute.time_s(batch)
    return ScalingCurve(topology, list(worker_counts), t_iter, t_comp, t_comm, baseline, weak)


def local_batches(batch: int, weak: bool, worker_counts: list[int] = DEFAULT_WORKER_COUNTS) -> list[float]:
    """The local batch sizes a prediction will ask T_comp about (what to measure)."""
    return [float(batch)] if weak else [batch / n for n in worker_counts if batch / n >= 1]
