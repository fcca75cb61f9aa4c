"""Loss curves as the studies read them: moving means and the area under a curve (SHM-Learn-Dist §5's metric)."""

from __future__ import annotations


def moving_mean(ys: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start); NaN stays NaN."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def area_under(xs: list[float], ys: list[float]) -> float:
    """Trapezoidal area under ``ys(xs)``, from the first point to the last."""
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
