"""Figures of a sweep (SHM-Learn-Dist §5), per worker count: the heatmap of areas (Figs. 5.5-5.8), the
areas sorted by minimum loss (Figs. 5.1-5.4), and the loss curves behind them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parambox.report.plots import plt, save_figure

STATUS_COLOURS = {"ok": "tab:green", "above_threshold": "tab:gray", "diverged": "tab:red", "failed": "black"}
AREA_LABEL = "area under loss-vs-time curve (loss x s)"


def write_all(results: dict[str, Any], out: Path) -> list[Path]:
    paths = []
    for n in results["grid"]["workers"]:
        runs = [r for r in results["runs"] if r["workers"] == n]
        winner = (results["winners"].get(str(n)) or {}).get("name")
        paths.append(heatmap(results, runs, n, winner, out / f"heatmap_workers{n}.png"))
        paths.append(area_bars(results, runs, n, winner, out / f"areas_workers{n}.png"))
        paths.append(loss_curves(runs, n, out / f"loss_workers{n}.png"))
    return paths


def _label(r: dict[str, Any], with_strategy: bool) -> str:
    text = f"b={r['batch_size']}\nlr={r['lr']:g}"
    return f"{r['strategy']}\n{text}" if with_strategy else text


def _winner_text(results: dict[str, Any], n: int) -> str:
    w = results["winners"].get(str(n))
    if w is None:
        return "no run reached the loss threshold"
    return f"best: {w['strategy']}, batch {w['batch_size']}, lr {w['lr']:g} (area {w['area']:.3g} loss x s)"


def heatmap(results: dict[str, Any], runs: list[dict], n: int, winner: str | None, path: Path) -> Path:
    """Batch size x learning rate, colour = area; diverged cells empty (as in the report), winner boxed."""
    strategies = results["grid"]["strategy"]
    batches, lrs = results["grid"]["batch_size"], results["grid"]["lr"]
    fig, axes = plt.subplots(
        1, len(strategies), figsize=(1.6 * len(lrs) + 3, 1.0 * len(batches) + 2.2), squeeze=False
    )
    areas = [r["area"] for r in runs if r["status"] in ("ok", "above_threshold") and r["area"] is not None]
    vmin, vmax = (min(areas), max(areas)) if areas else (0.0, 1.0)
    image = None
    for ax, strategy in zip(axes[0], strategies):
        cells = {(r["batch_size"], r["lr"]): r for r in runs if r["strategy"] == strategy}
        grid = [[_cell_value(cells.get((b, lr))) for lr in lrs] for b in batches]
        image = ax.imshow(grid, cmap="viridis_r", vmin=vmin, vmax=vmax, aspect="auto")
        for i, b in enumerate(batches):
            for j, lr in enumerate(lrs):
                _annotate(ax, i, j, cells.get((b, lr)), winner)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("learning rate")
        ax.set_ylabel("batch size per worker")
        ax.set_title(strategy if len(strategies) > 1 else "", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label=AREA_LABEL)
    fig.suptitle(
        f"{results['model']} on {results['data']}, {n} worker(s): area under the loss curve "
        f"(lower is better)\n{_winner_text(results, n)}; grey: diverged, x: min loss above "
        f"{results['loss_threshold']:g}",
        fontsize=9,
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _cell_value(r: dict | None) -> float:
    ok = r is not None and r["status"] in ("ok", "above_threshold") and r["area"] is not None
    return r["area"] if ok else float("nan")  # NaN cells stay empty: diverged or failed


def _annotate(ax, i: int, j: int, r: dict | None, winner: str | None) -> None:
    if r is None:
        return
    if r["status"] in ("diverged", "failed"):
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="lightgray"))
        ax.text(j, i, r["status"], ha="center", va="center", fontsize=8, color="tab:red")
        return
    mark = " x" if r["status"] == "above_threshold" else ""
    ax.text(
        j,
        i,
        f"{r['area']:.3g}{mark}",
        ha="center",
        va="center",
        fontsize=8,
        color="white",
        bbox={"facecolor": "black", "alpha": 0.35, "pad": 1, "lw": 0},
    )
    if r["name"] == winner:
        ax.add_patch(plt.Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, ec="red", lw=2.5))


def area_bars(results: dict[str, Any], runs: list[dict], n: int, winner: str | None, path: Path) -> Path:
    """The report's histogram: one bar per run, sorted by min loss (lowest first); min loss on a twin axis."""
    with_strategy = len(results["grid"]["strategy"]) > 1
    # Diverged and failed runs go last: their min loss (if any) says nothing about how well they learnt.
    ordered = sorted(runs, key=lambda r: (r["status"] in ("diverged", "failed"), r["min_loss"] or 0.0))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(ordered) + 2) + 2.5, 4.8))
    xs = range(len(ordered))
    heights = [r["area"] if r["area"] is not None and r["status"] != "diverged" else 0.0 for r in ordered]
    bars = ax.bar(xs, heights, color=[STATUS_COLOURS[r["status"]] for r in ordered])
    for bar, r in zip(bars, ordered):
        if r["name"] == winner:
            bar.set_edgecolor("red")
            bar.set_linewidth(2.5)
        if r["status"] in ("diverged", "failed"):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                0,
                r["status"],
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=8,
                color="tab:red",
            )
    ax.set_xticks(list(xs), [_label(r, with_strategy) for r in ordered], fontsize=7)
    ax.set_xlabel("run (batch size per worker, learning rate), sorted by minimum loss")
    ax.set_ylabel(AREA_LABEL)
    twin = ax.twinx()
    twin.plot(xs, [r["min_loss"] for r in ordered], "k.", label="min loss (moving mean)")
    twin.axhline(results["loss_threshold"], color="k", ls="--", lw=0.8, label="loss threshold")
    twin.set_ylabel("minimum training loss")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATUS_COLOURS.values()]
    ax.legend(
        handles + twin.get_legend_handles_labels()[0],
        [*STATUS_COLOURS, *twin.get_legend_handles_labels()[1]],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.12, 1.0),
    )
    ax.set_title(
        f"{results['model']} on {results['data']}, {n} worker(s): areas sorted by min loss\n"
        f"{_winner_text(results, n)}",
        fontsize=9,
    )
    return save_figure(fig, path)


def loss_curves(runs: list[dict], n: int, path: Path) -> Path:
    """Training loss against time of every run with this worker count (moving mean over 1/20 of the run)."""
    from parambox.report import load_run
    from parambox.studies.curves import moving_mean

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for r in runs:
        if r["status"] == "failed":
            continue
        times, losses = load_run(r["run_dir"]).series("loss", "time")
        ls = "-" if r["status"] == "ok" else ":"
        ax.plot(
            times,
            moving_mean(losses, max(1, len(losses) // 20)),
            ls,
            lw=1.2,
            label=f"{r['strategy']} b={r['batch_size']} lr={r['lr']:g} ({r['status']})",
        )
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("training loss (moving mean)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    else:  # every run failed: say so on the figure (a legend of nothing warns on the user's screen)
        ax.text(0.5, 0.5, "no run to plot: every one failed", transform=ax.transAxes, ha="center")
    ax.set_title(f"{n} worker(s): training loss against time; dotted: not qualifying", fontsize=9)
    return save_figure(fig, path)
