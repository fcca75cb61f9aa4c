"""Plots of runs (matplotlib, Agg backend): one line per run, labelled axes with units, legends, titles.

The helpers draw on an axes you give them (``plot_runs``, ``plot_comm_bars``), so sweeps and studies can
compose their own figures; the ``figure_*`` functions write the standard report figures.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from parambox.report.runs import Run  # noqa: E402

AXIS_LABELS = {
    "time": "time since start (s)",
    "step": "step",
    "loss": "training loss",
    "test_loss": "test loss",
    "test_accuracy": "test accuracy (%)",
    "samples_per_s": "throughput (samples/s, all workers)",
}


def smooth(ys: list[float], alpha: float) -> list[float]:
    """Exponential moving average (alpha = weight of the past; 0 = no smoothing), for noisy loss curves."""
    out, avg = [], None
    for y in ys:
        avg = y if avg is None or alpha <= 0 else alpha * avg + (1 - alpha) * y
        out.append(avg)
    return out


def _as_percent(ys: list[float]) -> list[float]:
    # Accuracy may be recorded as a fraction or a percentage; plot percent either way.
    return [100 * y for y in ys] if ys and max(ys) <= 1.0 else ys


def plot_runs(
    ax: Axes, runs: list[Run], y: str, x: str = "time", kind: str = "step", smoothing: float = 0.0
) -> int:
    """One line per run of ``y`` against ``x`` from the ``kind`` records; returns how many runs had data."""
    drawn = 0
    for run in runs:
        xs, ys = run.series(y, x, kind)
        if not xs:
            continue
        if y == "test_accuracy":
            ys = _as_percent(ys)
        style = {"marker": "o", "ms": 3} if kind == "eval" else {"lw": 1.2}
        ax.plot(xs, smooth(ys, smoothing) if kind == "step" else ys, label=run.label, **style)
        drawn += 1
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def plot_comm_bars(ax: Axes, runs: list[Run]) -> int:
    """Stacked bars: mean communication time per step (ms), one bar per run, one colour per phase."""
    phases = list(dict.fromkeys(ph for r in runs for ph in r.comm_phases()))
    bottoms = [0.0] * len(runs)
    for ph in phases:
        heights = [r.mean_comm_ms().get(ph, 0.0) for r in runs]
        ax.bar(range(len(runs)), heights, bottom=bottoms, label=ph)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(runs)), [r.label for r in runs], rotation=30 if len(runs) > 3 else 0, ha="right")
    ax.set_ylabel("communication time per step (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    if phases:
        ax.legend(title="phase", fontsize=8)
    return len(phases)


def plot_comm_steps(ax: Axes, run: Run) -> int:
    """Stacked areas: communication time per phase (ms) at each step of one run."""
    phases = run.comm_phases()
    steps = [r["step"] for r in run.steps]
    stacks = [[(r.get("comm") or {}).get(ph, 0.0) * 1e3 for r in run.steps] for ph in phases]
    if phases:
        ax.stackplot(steps, stacks, labels=phases, alpha=0.85)
        ax.legend(title="phase", fontsize=8, loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("communication time (ms)")
    ax.set_title(f"communication per phase: {run.label}")
    ax.grid(True, alpha=0.3)
    return len(phases)


def save_figure(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure_pair(
    runs: list[Run], y: str, kind: str, title: str, path: Path, smoothing: float = 0.0
) -> Path | None:
    """``y`` against time (left) and against step (right); None (no file) when no run has the data."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = plot_runs(left, runs, y, "time", kind, smoothing)
    plot_runs(right, runs, y, "step", kind, smoothing)
    if not drawn:
        plt.close(fig)
        return None
    left.set_title(f"{title} vs time")
    right.set_title(f"{title} vs step")
    return save_figure(fig, path)


def figure_throughput(runs: list[Run], path: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if not plot_runs(ax, runs, "samples_per_s", "time", "step"):
        plt.close(fig)
        return None
    ax.set_title("throughput over time")
    return save_figure(fig, path)


def figure_comm_bars(runs: list[Run], path: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs) + 3), 4.5))
    if not plot_comm_bars(ax, runs):
        plt.close(fig)
        return None
    ax.set_title("mean communication time per step, by phase")
    return save_figure(fig, path)


def figure_comm_steps(run: Run, path: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if not plot_comm_steps(ax, run):
        plt.close(fig)
        return None
    return save_figure(fig, path)
