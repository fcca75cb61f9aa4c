"""``parambox sweep``: the hyper-parameter grid of SHM-Learn-Dist §5, and the studies built on it.

``parambox sweep`` (``--study grid``, the default) trains every combination of ``--workers`` x
``--batch-size`` x ``--lr`` (x ``--strategy``), one run after the other, each seeing the same number of
samples: a run does ``steps = samples // (workers * batch_size)`` steps (``--samples``; or ``--steps``,
the steps of the run with the smallest global batch, so ``samples = steps * min(workers * batch)``).
Each run is scored as in the report: runs whose minimum training loss (a moving mean over 1/20 of
the run, so one lucky batch does not count) stays above ``--loss-threshold`` are out; of the rest,
the one with the smallest area under its loss-vs-time curve (loss x seconds, start-up excluded) wins,
per worker count. A run is *diverged* when its loss became non-finite or blew up (above 2x its initial
value, the first step's loss); a run that never reached the threshold is *above_threshold*, noted
"no progress" when its final loss is above 90 % of its initial loss (stuck, e.g. dead ReLUs).

Writes ``OUT/results.json`` (every run's figures and ``winners``), ``table.md`` (Table 5.1, also
printed), ``heatmap_workers{N}.png`` (Figs. 5.5-5.8), ``areas_workers{N}.png`` (Figs. 5.1-5.4) and
``loss_workers{N}.png``; the runs themselves live in ``OUT/runs/``. Running the same command again
with the same ``--out`` reuses finished runs and redoes unfinished ones.

``--study neuron`` is the single-neuron study (§3; preset ``neuron-study``): a sigmoid neuron learning
the step function, 2/4/8/16 workers simulated in one process, gradient- and weight-averaged; writes
``loss_curves.png`` (Fig. 2.1), ``smoothness.png`` and ``results.json``, after checking the simulation
against real runs at 2 and 4 workers (``--cross-check-steps``; ``--no-cross-check`` skips them).
``--study scaling`` is the scaling study (§6; preset ``scaling-study``, ps-sync): 1..N workers per
``--strategy``, loss and accuracy against time, gather/average/broadcast time per worker count and
time to ``--target-accuracy``. See ``parambox.experiments.neuron`` and ``parambox.experiments.scaling``.

    parambox sweep --workers 1,2 --batch-size 16,32,64 --lr 0.05,0.1,0.2 --out sweeps/digits
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from parambox.config import merge
from parambox.errors import UserError
from parambox.experiments.launch import (
    PlannedRun,
    all_finite,
    area_under,
    base_config,
    ensure_runs,
    moving_mean,
    parse_list,
    validate,
)

# Per data set: (samples per run, loss threshold). 24,576 = 2^13 * 3 divides every global batch of
# 16..512 x 1..8 workers (the report chose 307,200 for CIFAR-10 the same way); the CIFAR-10 threshold
# is the report's 1.8, the others sit where a run has clearly learnt (digits: ~95 % train accuracy).
DATASET_DEFAULTS: dict[str, tuple[int, float]] = {
    "digits": (24_576, 0.3),
    "synthetic": (24_576, 0.3),
    "step": (24_576, 0.3),
    "mnist": (307_200, 0.3),
    "cifar10": (307_200, 1.8),
}
FALLBACK_DEFAULTS = (24_576, 0.5)
BLOWUP_FACTOR = 2.0  # loss above this multiple of its initial value: diverged
NO_PROGRESS_RATIO = 0.9  # final loss above this fraction of the initial loss: noted as "no progress"
STUDIES = ("grid", "neuron", "scaling")
CROSS_CHECK_STEPS = 1000


# -- command line ------------------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__  # `parambox sweep --help` explains the metric, the files and the studies
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--study", choices=STUDIES, default="grid", help="grid (default), neuron (§3), scaling (§6)"
    )
    p.add_argument("--preset", help="base run config (default: digits-sweep, neuron-study or scaling-study)")
    p.add_argument("--strategy", help="comma list of strategies (default: the preset's)")
    p.add_argument("--workers", help="comma list (grid default 1,2; neuron 2,4,8,16; scaling 1,2)")
    p.add_argument("--batch-size", help="comma list of per-worker batch sizes (grid default 16,32,64)")
    p.add_argument("--lr", help="comma list of learning rates (grid default 0.05,0.1,0.2)")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--samples", type=int, help="samples every run sees (default per data set: 24,576 on digits)"
    )
    size.add_argument(
        "--steps", type=int, help="steps of the run with the smallest global batch (neuron: per worker)"
    )
    p.add_argument(
        "--loss-threshold", type=float, help="grid: min loss a run must reach (default per data set)"
    )
    p.add_argument("--target-accuracy", type=float, help="scaling: test accuracy for time-to-accuracy (0..1)")
    for flag in ("--model", "--data", "--data-path"):
        p.add_argument(flag)
    p.add_argument("--seed", type=int)
    p.add_argument("--momentum", type=float)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any run field")
    p.add_argument("--out", type=Path, help="output directory (default sweeps/STUDY-TIME); rerun to resume")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one training run may take")
    p.add_argument(
        "--no-cross-check", dest="cross_check", action="store_false", help="neuron: skip real runs"
    )
    p.add_argument(
        "--cross-check-steps", type=int, default=CROSS_CHECK_STEPS, help="neuron: steps of each real run"
    )


def run(args: argparse.Namespace) -> int:
    args.out = args.out or Path(f"sweeps/{args.study}-{time.strftime('%Y%m%d-%H%M%S')}")
    for flag, value in (("--samples", args.samples), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.study != "neuron" and (not args.cross_check or args.cross_check_steps != CROSS_CHECK_STEPS):
        print(
            "parambox: warning: --no-cross-check and --cross-check-steps apply to --study neuron only",
            file=sys.stderr,
        )
    if args.study == "neuron":
        from parambox.experiments.neuron import run_from_args

        return run_from_args(args)
    if args.study == "scaling":
        from parambox.experiments.scaling import run_from_args

        return run_from_args(args)
    if args.target_accuracy is not None:
        raise UserError("--target-accuracy applies to --study scaling; a grid uses --loss-threshold")
    base = base_config(args, "digits-sweep")
    t0 = time.perf_counter()
    results = run_sweep(
        args.out,
        base,
        workers=parse_list(args.workers or "1,2", int, "--workers"),
        batch_sizes=parse_list(args.batch_size or "16,32,64", int, "--batch-size"),
        lrs=parse_list(args.lr or "0.05,0.1,0.2", float, "--lr"),
        strategies=parse_list(args.strategy, str, "--strategy") if args.strategy else None,
        samples=args.samples,
        steps=args.steps,
        loss_threshold=args.loss_threshold,
        run_timeout_s=args.run_timeout,
    )
    print_winners(results)
    print(f"sweep took {time.perf_counter() - t0:.0f} s; results in {args.out / 'results.json'}")
    return 0


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
    from parambox.experiments import sweep_figures

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
    sweep_figures.write_all(results, out)
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
                    print(
                        f"parambox: warning: {n} x {b} does not divide --samples {samples}: its runs "
                        f"see {steps * n * b}",
                        file=sys.stderr,
                    )
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
    rec["area"] = area_under(times, losses) if all_finite(losses) else None
    for key in ("wall_time_s", "samples_per_s", "final_test_accuracy", "final_test_loss"):
        value = run.summary.get(key)
        rec[key] = value if isinstance(value, int | float) and math.isfinite(value) else None
    return rec


def judge_curve(losses: list[float], threshold: float) -> tuple[str, str, dict[str, float | None]]:
    """(status, reason, {min_loss, initial_loss, final_loss}) of one loss curve (moving mean over 1/20)."""
    if not losses:
        return "failed", "no step records", {"min_loss": None}
    if not all_finite(losses):
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
