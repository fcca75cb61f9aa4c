"""Figures of the single-neuron study: the loss curves per worker count (SHM-Learn-Dist Fig. 2.1) and
the roughness of those curves against the worker count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parambox.report.plots import plt, save_figure
from parambox.studies.curves import moving_mean


def write_all(curves: dict[tuple[str, int], torch.Tensor], results: dict[str, Any], out: Path) -> list[Path]:
    return [
        loss_panels(curves, results, out / "loss_curves.png"),
        roughness_plot(results, out / "smoothness.png"),
    ]


def loss_panels(curves: dict[tuple[str, int], torch.Tensor], results: dict[str, Any], path: Path) -> Path:
    """One panel per (scheme, worker count): the loss at each step (light) and its moving mean (dark)."""
    schemes = list(results["schemes"])
    workers = results["setup"]["workers"]
    fig, axes = plt.subplots(
        len(schemes),
        len(workers),
        figsize=(3.2 * len(workers), 2.8 * len(schemes)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for i, scheme in enumerate(schemes):
        for j, n in enumerate(workers):
            ax, curve = axes[i][j], curves[(scheme, n)].tolist()
            steps = range(1, len(curve) + 1)
            window = max(1, len(curve) // 50)
            ax.plot(steps, curve, lw=0.4, alpha=0.5, color="tab:blue", label="loss at each step")
            ax.plot(
                steps, moving_mean(curve, window), lw=1.2, color="tab:red", label=f"mean of {window} steps"
            )
            rough = results["schemes"][scheme][str(n)]["roughness"]
            ax.set_title(f"{scheme}, {n} workers\nroughness {rough:.3f}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if i == len(schemes) - 1:
                ax.set_xlabel("step (per worker)")
            if j == 0:
                ax.set_ylabel("logistic loss\n(mean over workers)")
    axes[0][0].legend(fontsize=7, loc="upper right")
    setup = results["setup"]
    fig.suptitle(
        f"single sigmoid neuron learning the step function: lr {setup['lr']:g}, "
        f"{setup['batch_size']} sample(s) per worker per step",
        fontsize=10,
    )
    return save_figure(fig, path)


def roughness_plot(results: dict[str, Any], path: Path) -> Path:
    """Roughness (std of step-to-step loss changes) against workers, with the 1/sqrt(n) of averaging."""
    workers = results["setup"]["workers"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for scheme, marker in zip(results["schemes"], ("o-", "s--")):
        ax.plot(
            workers, [results["schemes"][scheme][str(n)]["roughness"] for n in workers], marker, label=scheme
        )
    first = results["schemes"]["gradient-averaged"][str(workers[0])]["roughness"]
    ax.plot(
        workers,
        [first * (workers[0] / n) ** 0.5 for n in workers],
        "k:",
        lw=1,
        label=r"$\propto 1/\sqrt{workers}$ (averaging independent samples)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(workers, [str(n) for n in workers])
    ax.set_xlabel("workers")
    ax.set_ylabel("roughness: std of step-to-step loss change")
    ax.set_title("more workers, smoother loss curve (SHM-Learn-Dist §3)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
