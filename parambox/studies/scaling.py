"""The scaling study (SHM-Learn-Dist §6, Figs. 6.2-6.6): ``parambox sweep --study scaling``.

Trains each ``--strategy`` with each worker count of ``--workers`` (default: the ``scaling-study``
preset, a parameter server on rank 0 that gathers gradients, averages them and broadcasts weights),
every run seeing the same number of samples as in the report (``steps = samples // (workers * batch)``)
and evaluating about ten times. Writes to OUT:

- ``loss_{strategy}.png`` and ``accuracy_{strategy}.png``: training loss and test accuracy against time,
  one line per worker count (Figs. 6.2, 6.3);
- ``comm_phases.png``: mean time per step of each communication phase against workers, one panel per
  phase; for ``ps-sync`` these are gather, average and broadcast (Figs. 6.4-6.6);
- ``time_to_accuracy.png``: seconds of training until the test accuracy first reaches
  ``--target-accuracy``, strategies side by side per worker count;
- ``results.json`` and ``table.md`` (also printed); the runs live in ``OUT/runs/`` (rerun to resume).

More workers than cores is allowed (oversubscription) but then the workers share cores, so times
no longer show how the strategy scales; the study says so in its output.

    parambox sweep --study scaling --strategy ps-sync,allreduce --workers 1,2,4 --out sweeps/scaling
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parambox.config import merge
from parambox.errors import UserError, warn
from parambox.studies.runs import DATASET_DEFAULTS, FALLBACK_DEFAULTS, PlannedRun, ensure_runs, validate

# Default --target-accuracy per data set (a level every sensible run reaches, so the bars compare speed).
TARGET_ACCURACY = {"digits": 0.9, "synthetic": 0.9, "step": 0.95, "mnist": 0.97, "cifar10": 0.6}
EVALS_PER_RUN = 10
PHASE_ORDER = ("average", "gather", "broadcast")  # the report's Figs. 6.4, 6.5, 6.6


def plan_runs(
    base: dict[str, Any], strategies: list[str], workers: list[int], samples: int
) -> list[PlannedRun]:
    """One run per (strategy, workers) the strategy accepts (``single``: 1 worker only). Validated
    before anything runs."""
    from parambox.strategies import strategy_class

    planned = []
    for strategy in strategies:
        for n in workers:
            if not strategy_class(strategy).accepts_workers(n):
                continue
            steps = samples // (n * base["batch_size"])
            if steps < 1:
                raise UserError(
                    f"--samples {samples} is less than one global batch ({n} x {base['batch_size']})"
                )
            cfg = merge(
                base,
                {
                    "strategy": strategy,
                    "workers": n,
                    "steps": steps,
                    "eval_every": max(1, steps // EVALS_PER_RUN),
                },
            )
            validate(cfg)
            planned.append(PlannedRun(f"{strategy}-w{n}", cfg))
    if not planned:
        raise UserError(f"no run to do: strategies {strategies} accept none of the worker counts {workers}")
    return planned


def run_scaling_study(
    out: str | Path,
    base: dict[str, Any],
    strategies: list[str] | None = None,
    workers: list[int] | tuple[int, ...] = (1, 2),
    samples: int | None = None,
    target_accuracy: float | None = None,
    run_timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run (or resume) the study in ``out``; write results.json, table.md and the figures.

    >>> run_scaling_study("sweeps/scaling", preset("scaling-study"), ["ps-sync"], [1, 2, 4])  # doctest: +SKIP
    """
    from parambox.studies.figures import scaling as figures

    out = Path(out)
    data = base.get("data", "digits")
    strategies = strategies or [base.get("strategy", "ps-sync")]
    samples = samples or DATASET_DEFAULTS.get(data, FALLBACK_DEFAULTS)[0]
    target = TARGET_ACCURACY.get(data, 0.9) if target_accuracy is None else target_accuracy
    planned = plan_runs(base, strategies, list(workers), samples)
    cores = os.cpu_count() or 1
    if max(workers) > cores:
        warn(
            f"{max(workers)} workers on {cores} cores: oversubscribed runs share cores, "
            "so their times do not show how the strategy scales"
        )
    outcomes = ensure_runs(planned, out / "runs", run_timeout_s)
    results = {
        "study": "scaling",
        "data": data,
        "model": base.get("model"),
        "samples_per_run": samples,
        "target_accuracy": target,
        "cores": cores,
        "oversubscribed": max(workers) > cores,
        "strategies": strategies,
        "workers": list(workers),
        "runs": [describe_run(p, o, target, cores) for p, o in zip(planned, outcomes)],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table_markdown(results))
    figures.write_all(results, out, phases_of(results))
    return results


def describe_run(p: PlannedRun, outcome, target: float, cores: int) -> dict[str, Any]:
    """One run's figures: time, throughput, accuracy, time to the target accuracy, comm ms per phase."""
    from parambox.report import load_run

    cfg = p.config
    rec: dict[str, Any] = {
        "name": p.name,
        "run_dir": str(outcome.run_dir),
        "strategy": cfg["strategy"],
        "workers": cfg["workers"],
        "steps": cfg["steps"],
        "oversubscribed": cfg["workers"] > cores,
    }
    if outcome.error:
        return rec | {"status": "failed", "reason": outcome.error}
    run = load_run(outcome.run_dir)
    times, accs = run.series("test_accuracy", "time", "eval")
    reached = next((t for t, a in zip(times, accs) if a >= target), None)
    return rec | {
        "status": "ok",
        "wall_time_s": run.summary.get("wall_time_s"),
        "samples_per_s": run.summary.get("samples_per_s"),
        "final_test_accuracy": run.summary.get("final_test_accuracy"),
        "time_to_accuracy_s": reached,
        "comm_ms_per_step": run.mean_comm_ms(),
    }


def phases_of(results: dict[str, Any]) -> list[str]:
    """Communication phases recorded by any run, the report's three first."""
    seen = dict.fromkeys(ph for r in results["runs"] for ph in r.get("comm_ms_per_step", {}))
    return [ph for ph in PHASE_ORDER if ph in seen] + [ph for ph in seen if ph not in PHASE_ORDER]


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    phases = phases_of(results)
    header = [
        "strategy",
        "workers",
        "steps",
        "train time (s)",
        "samples/s",
        "test accuracy (%)",
        f"time to {100 * results['target_accuracy']:g} % (s)",
    ] + [f"{ph} (ms/step)" for ph in phases]

    def num(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    for r in results["runs"]:
        if r["status"] != "ok":
            rows.append(
                [r["strategy"], str(r["workers"]), str(r["steps"]), f"failed: {r['reason'][:80]}"]
                + [""] * (len(header) - 4)
            )
            continue
        acc = r["final_test_accuracy"]
        row = [
            r["strategy"],
            f"{r['workers']}{' *' if r['oversubscribed'] else ''}",
            str(r["steps"]),
            num(r["wall_time_s"], ".2f"),
            num(r["samples_per_s"], ",.0f"),
            num(acc and 100 * acc, ".2f"),
            num(r["time_to_accuracy_s"], ".2f") if r["time_to_accuracy_s"] is not None else "not reached",
        ]
        rows.append(row + [num(r["comm_ms_per_step"].get(ph), ".3f") for ph in phases])
    return header, rows


def table_markdown(results: dict[str, Any]) -> str:
    from parambox.report.page import markdown_table

    header, rows = table_rows(results)
    note = (
        f"\n\n\\* {results['cores']} cores: runs with more workers than cores share them; their times "
        "are distorted."
        if results["oversubscribed"]
        else ""
    )
    return (
        f"# Scaling study: {results['model']} on {results['data']}\n\n"
        f"{results['samples_per_run']:,} samples per run; comm columns: mean time per step.\n\n"
        f"{markdown_table(header, rows)}{note}\n"
    )


def print_summary(results: dict[str, Any]) -> None:
    """A narrow table for the terminal (table.md has every column)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scaling study: {results['model']} on {results['data']}")
    for h in (
        "strategy",
        "workers",
        "train time (s)",
        "test acc. (%)",
        f"time to {100 * results['target_accuracy']:g} % (s)",
        "comm (ms/step)",
    ):
        table.add_column(h)
    for r in results["runs"]:
        if r["status"] != "ok":
            table.add_row(r["strategy"], str(r["workers"]), "failed", r["reason"][:40], "", "")
            continue
        acc, tta = r["final_test_accuracy"], r["time_to_accuracy_s"]
        table.add_row(
            r["strategy"],
            str(r["workers"]),
            f"{r['wall_time_s']:.2f}",
            "-" if acc is None else f"{100 * acc:.2f}",
            "not reached" if tta is None else f"{tta:.2f}",
            f"{sum(r['comm_ms_per_step'].values()):.3f}",
        )
    Console().print(table)
    if results["oversubscribed"]:
        print(f"note: more workers than the {results['cores']} cores: those runs' times are distorted")
