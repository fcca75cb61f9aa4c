"""Figures of the scaling study: loss and accuracy against time per worker count (SHM-Learn-Dist
Figs. 6.2, 6.3), communication time per phase against workers (Figs. 6.4-6.6), time to accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parambox.report import load_run, plot_runs
from parambox.report.plots import plt, save_figure

LOSS_SMOOTHING = 0.9  # EMA weight of the past: per-step losses of small batches are noisy


def write_all(results: dict[str, Any], out: Path, phases: list[str]) -> list[Path]:
    """Every figure of the study; ``phases``: the communication phases to plot, in order."""
    paths = []
    for strategy in results["strategies"]:
        runs = []
        for r in results["runs"]:
            if r["strategy"] == strategy and r["status"] == "ok":
                run = load_run(r["run_dir"])
                run.label = f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}"
                runs.append(run)
        if runs:
            paths.append(
                _curves(
                    runs,
                    "loss",
                    "step",
                    f"{strategy}: training loss (EMA {LOSS_SMOOTHING:g})",
                    out / f"loss_{strategy}.png",
                )
            )
            paths.append(
                _curves(
                    runs,
                    "test_accuracy",
                    "eval",
                    f"{strategy}: test accuracy",
                    out / f"accuracy_{strategy}.png",
                )
            )
    if phases:
        paths.append(comm_panels(results, phases, out / "comm_phases.png"))
    paths.append(time_to_accuracy(results, out / "time_to_accuracy.png"))
    return paths


def _curves(runs: list, y: str, kind: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plot_runs(ax, runs, y, "time", kind, LOSS_SMOOTHING if kind == "step" else 0.0)
    ax.set_title(f"{title} against time, same samples per run")
    return save_figure(fig, path)


def comm_panels(results: dict[str, Any], phases: list[str], path: Path) -> Path:
    """One panel per communication phase: mean ms per step against workers, a line per strategy."""
    fig, axes = plt.subplots(1, len(phases), figsize=(4.2 * len(phases), 4.0), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for strategy in results["strategies"]:
            pts = [
                (r["workers"], r["comm_ms_per_step"][phase])
                for r in results["runs"]
                if r["strategy"] == strategy and r["status"] == "ok" and phase in r["comm_ms_per_step"]
            ]
            if pts:
                ax.plot(*zip(*pts), "o-", label=strategy)
        ax.set_xticks(results["workers"])
        ax.set_xlabel("workers")
        ax.set_ylabel(f"{phase}: mean time per step (ms)")
        ax.set_title(phase, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    note = " (more workers than cores: times distorted)" if results["oversubscribed"] else ""
    fig.suptitle(f"communication time per phase against workers{note}", fontsize=10)
    return save_figure(fig, path)


def time_to_accuracy(results: dict[str, Any], path: Path) -> Path:
    """Grouped bars: per worker count, one bar per strategy; runs that never got there are marked."""
    strategies, workers = results["strategies"], results["workers"]
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(workers) * len(strategies) + 2), 4.5))
    for i, strategy in enumerate(strategies):
        by_n = {r["workers"]: r for r in results["runs"] if r["strategy"] == strategy}
        for j, n in enumerate(workers):
            r = by_n.get(n)
            x = j + (i - (len(strategies) - 1) / 2) * width
            t = r.get("time_to_accuracy_s") if r else None
            if t is not None:
                ax.bar(x, t, width, color=f"C{i}")
            elif r is not None:
                ax.text(
                    x,
                    0,
                    "not reached" if r["status"] == "ok" else "failed",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=f"C{i}",
                )
    ax.set_xticks(range(len(workers)), [str(n) for n in workers])
    ax.set_xlim(-0.6, len(workers) - 0.4)  # also when no bar was drawn (nothing reached the target)
    ax.set_xlabel("workers")
    ax.set_ylabel(f"training time to {100 * results['target_accuracy']:g} % test accuracy (s)")
    ax.set_title("time to accuracy per strategy (lower is better)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(strategies))]
    ax.legend(handles, strategies, fontsize=8)
    return save_figure(fig, path)
