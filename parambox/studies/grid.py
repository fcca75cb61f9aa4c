"""The hyper-parameter grid of SHM-Learn-Dist §5 (``parambox sweep``, ``--study grid``).

Every combination of workers x batch size x learning rate (x strategy) trains on the same number of
samples; runs are scored by the area under their loss-vs-time curve among those that reached the loss
threshold, and the smallest area wins per worker count (see ``parambox sweep --help`` for the metric
and the files written).

>>> run_sweep(Path("sweeps/d"), preset("digits-sweep"), [1, 2], [16, 32], [0.05, 0.1])  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parambox.config import merge
from parambox.errors import UserError, warn
from parambox.numerics import is_finite
from parambox.studies.curves import area_under, moving_mean
from parambox.studies.runs import DATASET_DEFAULTS, FALLBACK_DEFAULTS, PlannedRun, ensure_runs, validate

BLOWUP_FACTOR = 2.0  # loss above this multiple of its initial value: diverged
NO_PROGRESS_RATIO = 0.9  # final loss above this fraction of the initial loss: noted as "no progress"


# -- the grid ----------------------------------------------------------------------------------------


def run_sweep(
    out: Path,
    base: dict[str, Any],
    workers: list[int],
    batch_sizes: list[int],
    lrs: list[float],
    strategies: list[str] | None = None,
    samples: int | None = None,
    steps: int | None = None,
    loss_threshold: float | None = None,
    run_timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run (or resume) the grid in ``out`` and write results.json, table.md and the figures.

    >>> run_sweep(Path("sweeps/d"), preset("digits-sweep"), [1, 2], [16, 32], [0.05, 0.1])  # doctest: +SKIP
    """
    from parambox.studies.figures import grid as figures

    out = Path(out)
    data = base.get("data", "digits")
    default_samples, default_threshold = DATASET_DEFAULTS.get(data, FALLBACK_DEFAULTS)
    strategies = strategies or [base.get("strategy", "allreduce")]
    min_global = min(workers) * min(batch_sizes)
    samples = steps * min_global if steps else samples or default_samples
    threshold = default_threshold if loss_threshold is None else loss_threshold
    planned = plan_grid(base, strategies, workers, batch_sizes, lrs, samples)
    outcomes = ensure_runs(planned, out / "runs", run_timeout_s)
    runs = [score_run(p, o, threshold) for p, o in zip(planned, outcomes)]
    results = {
        "study": "sweep",
        "data": data,
        "model": base.get("model"),
        "samples_per_run": samples,
        "loss_threshold": threshold,
        "threshold_source": "--loss-threshold" if loss_threshold is not None else f"default for {data}",
        "grid": {"strategy": strategies, "workers": workers, "batch_size": batch_sizes, "lr": lrs},
        "runs": runs,
        "winners": pick_winners(runs, workers),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table_markdown(results))
    figures.write_all(results, out)
    return results


def plan_grid(
    base: dict[str, Any],
    strategies: list[str],
    workers: list[int],
    batch_sizes: list[int],
    lrs: list[float],
    samples: int,
) -> list[PlannedRun]:
    """One run per grid point, each with ``samples // (workers * batch)`` steps; validated up front."""
    planned = []
    for strategy in strategies:
        for n in workers:
            for b in batch_sizes:
                steps = samples // (n * b)
                if steps < 1:
                    raise UserError(f"--samples {samples} is less than one global batch ({n} x {b})")
                if steps * n * b != samples:
                    warn(f"{n} x {b} does not divide --samples {samples}: its runs see {steps * n * b}")
                for lr in lrs:
                    cfg = merge(
                        base, {"strategy": strategy, "workers": n, "batch_size": b, "lr": lr, "steps": steps}
                    )
                    validate(cfg)
                    planned.append(PlannedRun(f"{strategy}-w{n}-b{b}-lr{lr:g}", cfg))
    return planned


def score_run(p: PlannedRun, outcome, threshold: float) -> dict[str, Any]:
    """A run's figures: status (ok / above_threshold / diverged / failed), area, min loss, test accuracy."""
    from parambox.report import load_run

    cfg = p.config
    rec: dict[str, Any] = {"name": p.name, "run_dir": str(outcome.run_dir), "launched": outcome.launched}
    rec |= {k: cfg[k] for k in ("strategy", "workers", "batch_size", "lr", "steps")}
    rec["samples"] = cfg["steps"] * cfg["workers"] * cfg["batch_size"]
    if outcome.error:
        return rec | {"status": "failed", "reason": outcome.error, "area": None, "min_loss": None}
    run = load_run(outcome.run_dir)
    times, losses = run.series("loss", "time")
    status, reason, curve = judge_curve(losses, threshold)
    rec |= {"status": status, "reason": reason, **curve}
    rec["area"] = area_under(times, losses) if is_finite(losses) else None
    for key in ("wall_time_s", "samples_per_s", "final_test_accuracy", "final_test_loss"):
        value = run.summary.get(key)
        rec[key] = value if is_finite(value) else None
    return rec


def judge_curve(losses: list[float], threshold: float) -> tuple[str, str, dict[str, float | None]]:
    """(status, reason, {min_loss, initial_loss, final_loss}) of one loss curve (moving mean over 1/20)."""
    if not losses:
        return "failed", "no step records", {"min_loss": None}
    if not is_finite(losses):
        return "diverged", "non-finite loss", {"min_loss": None}
    window = max(1, len(losses) // 20)
    smooth = moving_mean(losses, window)
    first, last, low = losses[0], smooth[-1], min(smooth)  # losses[0]: at the initial weights
    curve = {"min_loss": low, "initial_loss": first, "final_loss": last}
    if max(smooth) > BLOWUP_FACTOR * first:
        return "diverged", f"loss blew up (above {BLOWUP_FACTOR:g}x its initial {first:.3g})", curve
    if low > threshold:
        stuck = (
            f"; no progress (final {last:.3g} vs initial {first:.3g})"
            if last > NO_PROGRESS_RATIO * first
            else ""
        )
        return "above_threshold", f"min loss {low:.3g} > threshold {threshold:g}{stuck}", curve
    return "ok", "", curve


def pick_winners(runs: list[dict[str, Any]], workers: list[int]) -> dict[str, dict[str, Any] | None]:
    """Per worker count: the qualifying run (status ok) with the smallest area; None if none qualified."""
    winners: dict[str, dict[str, Any] | None] = {}
    for n in workers:
        ok = [r for r in runs if r["workers"] == n and r["status"] == "ok"]
        best = min(ok, key=lambda r: r["area"], default=None)
        winners[str(n)] = (
            None
            if best is None
            else {
                k: best[k]
                for k in ("name", "strategy", "batch_size", "lr", "area", "min_loss", "final_test_accuracy")
            }
        )
    return winners


# -- tables ------------------------------------------------------------------------------------------

TABLE_HEADER = [
    "workers",
    "strategy",
    "batch size",
    "learning rate",
    "area (loss x s)",
    "min loss",
    "test accuracy (%)",
]


def winner_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for n, w in results["winners"].items():
        if w is None:
            rows.append([n, "-", "-", "-", "none qualified", "-", "-"])
            continue
        acc = w["final_test_accuracy"]
        rows.append(
            [
                n,
                w["strategy"],
                str(w["batch_size"]),
                f"{w['lr']:g}",
                f"{w['area']:.3f}",
                f"{w['min_loss']:.4f}",
                "-" if acc is None else f"{100 * acc:.2f}",
            ]
        )
    return rows


RUNS_HEADER = [
    "run",
    "workers",
    "batch size",
    "lr",
    "steps",
    "status",
    "area (loss x s)",
    "min loss",
    "train time (s)",
    "why",
]


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_rows(results: dict[str, Any]) -> list[list[str]]:
    return [
        [r["name"], str(r["workers"]), str(r["batch_size"]), f"{r['lr']:g}", str(r["steps"]), r["status"]]
        + [_num(r["area"], ".3f"), _num(r.get("min_loss"), ".4f"), _num(r.get("wall_time_s"), ".1f")]
        + [r.get("reason") or ""]
        for r in results["runs"]
    ]


def table_markdown(results: dict[str, Any]) -> str:
    from parambox.report.page import markdown_table

    intro = (
        f"{results['samples_per_run']:,} samples per run; loss threshold {results['loss_threshold']:g} "
        f"({results['threshold_source']}). Winner per worker count: smallest area under the loss-vs-time "
        "curve among runs whose min loss reached the threshold (SHM-Learn-Dist Table 5.1)."
    )
    winners = markdown_table(TABLE_HEADER, winner_rows(results))
    runs = markdown_table(RUNS_HEADER, run_rows(results))
    return (
        f"# Sweep: {results['model']} on {results['data']}\n\n{intro}\n\n{winners}\n\n## All runs\n\n{runs}\n"
    )


def print_winners(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Sweep winners (loss threshold {results['loss_threshold']:g})")
    for h in TABLE_HEADER:
        table.add_column(h)
    for row in winner_rows(results):
        table.add_row(*row)
    Console().print(table)
    diverged = [r["name"] for r in results["runs"] if r["status"] in ("diverged", "failed")]
    if diverged:
        print(f"diverged or failed: {', '.join(diverged)}")
