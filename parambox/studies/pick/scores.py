"""How well ``parambox pick`` predicted: the scores its validation reports.

- ``rank_correlation``: Kendall's tau (tau-b, ties counted as scipy counts them) between the predicted
  and the measured times of the candidates validated in one seed; a candidate that did not reach the
  target counts as slower than every one that did.
- ``top1_hit_rate``: over seeds, the fraction in which the top pick was the fastest measured.
- ``prediction_error``: per strategy setup, the median over seeds of |predicted - measured| / measured;
  per family (synchronous, local SGD, asynchronous), the median over the family's setups.
- ``measured_repeatability``: Kendall's tau between two seeds' *measured* times, the median over pairs
  of seeds. No prediction can rank better than the measurement repeats: where this is low, the
  candidates' times differ by less than the runs' own spread, and ``rank_correlation`` cannot be high.

>>> kendall_tau([1.0, 2.0, 3.0], [10.0, 30.0, 20.0])
0.3333333333333333
>>> top1_hit_rate([("a", {"a": 1.0, "b": 2.0}), ("b", {"a": 1.0, "b": 2.0})])
0.5
>>> prediction_error([{"a": 2.0}, {"a": 4.0}], [{"a": 1.0}, {"a": 4.0}])
{'a': 0.5}
"""

from __future__ import annotations

import math
import statistics
from typing import Any

FAMILIES = ("synchronous", "local SGD", "asynchronous")


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b of two equally long lists (None for fewer than two pairs or a constant list).

    >>> kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]), kendall_tau([1, 1, 2], [1, 2, 3])
    (-1.0, 0.8164965809277261)
    """
    if len(x) != len(y):
        raise ValueError("kendall_tau: the lists differ in length")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = _sign(x[i] - x[j]), _sign(y[i] - y[j])
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif dx == dy:
                concordant += 1
            else:
                discordant += 1
    n0 = concordant + discordant
    denom = math.sqrt((n0 + ties_x) * (n0 + ties_y))
    return None if denom == 0 else (concordant - discordant) / denom


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def _slow_last(t: float | None) -> float:
    return math.inf if t is None else t


def seed_rank_correlation(
    predicted: dict[str, float | None], measured: dict[str, float | None]
) -> float | None:
    """Tau between predicted and measured times over the setups both have (unreached: slowest)."""
    keys = [k for k in measured if predicted.get(k) is not None]
    return kendall_tau([predicted[k] for k in keys], [_slow_last(measured[k]) for k in keys])


def top1_hit_rate(seeds: list[tuple[str | None, dict[str, float | None]]]) -> float | None:
    """Fraction of seeds ``(top pick, measured times)`` whose top pick was measured fastest."""
    scored = [(top, m) for top, m in seeds if any(v is not None for v in m.values())]
    if not scored:
        return None
    hits = sum(
        top is not None and m.get(top) == min(v for v in m.values() if v is not None) for top, m in scored
    )
    return hits / len(scored)


def prediction_error(
    predicted: list[dict[str, float | None]], measured: list[dict[str, float | None]]
) -> dict[str, float]:
    """Per setup: the median over seeds of |predicted - measured| / measured (where both exist)."""
    errors: dict[str, list[float]] = {}
    for pred, meas in zip(predicted, measured):
        for k, t in meas.items():
            p = pred.get(k)
            if t is not None and t > 0 and p is not None:
                errors.setdefault(k, []).append(abs(p - t) / t)
    return {k: statistics.median(v) for k, v in errors.items()}


def family(asynchronous: bool, local_steps: bool) -> str:
    """The strategy family a setup belongs to, from its strategy's class: ``asynchronous``: it tolerates a
    lost worker (``tolerates_worker_loss``); ``local_steps``: it steps locally between exchanges
    (``period_options``: weight-avg, diloco, easgd's synchronous form, hybrid).

    >>> family(True, True), family(False, True), family(False, False)
    ('asynchronous', 'local SGD', 'synchronous')
    """
    if asynchronous:
        return "asynchronous"
    return "local SGD" if local_steps else "synchronous"


def family_error(per_setup: dict[str, float], families: dict[str, str]) -> dict[str, float | None]:
    """Per family: the median of its setups' prediction errors (None: none of its setups measured)."""
    out: dict[str, float | None] = {}
    for f in FAMILIES:
        errs = [e for k, e in per_setup.items() if families.get(k) == f]
        out[f] = statistics.median(errs) if errs else None
    return out


def summarize_seeds(seeds: list[dict[str, Any]], families: dict[str, str]) -> dict[str, Any]:
    """The scores over seeds, from each seed's ``predicted_s``, ``measured_s`` and ``top_pick``."""
    predicted = [s["predicted_s"] for s in seeds]
    measured = [s["measured_s"] for s in seeds]
    taus = [seed_rank_correlation(p, m) for p, m in zip(predicted, measured)]
    valid = [t for t in taus if t is not None]
    per_setup = prediction_error(predicted, measured)
    ratios = [s.get("top_pick_vs_best_measured") for s in seeds]
    alone = [s.get("predicted_top_pick_vs_best_measured", s.get("top_pick_vs_best_measured")) for s in seeds]
    pairs = [
        seed_rank_correlation({k: v for k, v in a.items() if v is not None}, b)
        for i, a in enumerate(measured)
        for b in measured[i + 1 :]
    ]
    pairs = [t for t in pairs if t is not None]
    return {
        "rank_correlation": statistics.median(valid) if valid else None,
        "rank_correlation_per_seed": taus,
        "measured_repeatability": statistics.median(pairs) if pairs else None,
        "top1_hit_rate": top1_hit_rate([(s["top_pick"], s["measured_s"]) for s in seeds]),
        "top_pick_vs_best_measured_per_seed": ratios,
        "top_pick_within_1.2_of_best": sum(r is not None and r <= 1.2 for r in ratios),
        "predicted_top_pick_vs_best_measured_per_seed": alone,
        "predicted_top_pick_within_1.2_of_best": sum(r is not None and r <= 1.2 for r in alone),
        "prediction_error": per_setup,
        "prediction_error_by_family": family_error(per_setup, families),
        "families": families,
    }
