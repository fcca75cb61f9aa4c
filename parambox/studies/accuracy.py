"""Time to accuracy (issue 11): training seconds until a run's test accuracy first reaches a target,
the median over seeds, for each setup of ``parambox bench cluster`` at each link rate of an emulated
cluster. ``parambox sweep --study time-to-accuracy``; ``parambox pick --validate`` reuses it.

A setup is an entry of ``parambox.bench.cluster.SETUPS`` that is a parambox strategy (``ddp`` and the
``ceiling`` are not training runs: the synchronous baseline is ``allreduce``, which ``bench sync`` shows
at or above torch DDP's speed on these machines). A strategy registered there joins this study too.

Time to accuracy of one run (``first_crossing``): the run evaluates every ``eval_every`` steps; the
*training* clock at an evaluation is the step's time minus the time spent in earlier evaluations
(``training_clock``), so evaluating often costs the figure nothing; its error is bounded by the
training time of ``eval_every`` steps (the study reports this granularity per setup). A run that
never reaches the target counts as infinitely slow: the median over seeds (``median_time``) is
``None`` when more than half of the seeds missed.

Learning rates (``lr_for``), never tuned on the test set: synchronous and replica-averaging strategies
(allreduce, box-sync, weight-avg, EASGD, EAMSGD, hybrid) use the base ``--lr``; strategies in which
every worker's gradient steps land on one shared center (``Strategy.shared_center``: downpour, hogwild, and
dogwild, whose one optimizer on rank 0 takes each worker's gradient as a step) divide it by the
number of writers, since N asynchronous writers make the center's step N times the base step
(MEASURED: 2 writers double the effective step; the ``digits-hogwild`` and ``digits-dogwild`` presets).
DiLoCo keeps its own inner optimizer, AdamW at 1e-3 (``Strategy.default_optimizer``).

The clock is rank 0's, started where rank 0 started training; where another rank started earlier
(asynchronous runs do not wait for each other), its lead is added (``clock_lead``: the ``epoch`` of
each rank's first ``world`` record), so training rank 0 did not see still counts.

>>> first_crossing([(1.0, 0.5), (2.0, 0.97), (3.0, 0.99)], 0.98)
3.0
>>> median_time([3.0, None, 5.0])
5.0
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from parambox.config import merge
from parambox.errors import UserError
from parambox.strategies import STRATEGIES, strategy_class
from parambox.studies.runs import PlannedRun, clock_lead, ensure_runs, validate
from parambox.workload.targets import Target


def method_optimizer(strategy: str) -> dict[str, Any]:
    """The optimizer a strategy brings as part of its method (diloco: AdamW at 1e-3; with the base SGD
    under the outer Nesterov step it diverged on MNIST, 0.097); a strategy's default rate alone (the
    shared-center strategies' half rate for the default digits run) gives way to ``lr_for``."""
    own = strategy_class(strategy).default_optimizer
    return dict(own) if "optimizer" in own else {}


def lr_for(strategy: str, base_lr: float, workers: int) -> float:
    """The learning rate a setup trains with (the module's rule: base, or base / writers).

    >>> lr_for("downpour", 0.03, 2), lr_for("easgd", 0.03, 2)
    (0.015, 0.03)
    """
    return base_lr / workers if strategy_class(strategy).shared_center else base_lr


# -- the maths -------------------------------------------------------------------------------------


def training_clock(
    steps: list[dict], evals: list[dict], metric: str = "accuracy"
) -> list[tuple[float, float]]:
    """(training seconds, test ``metric``) at each evaluation, evaluation time taken out of the clock.

    ``steps``/``evals``: the rank-0 records of a run (``{"step", "time"}`` / ``{"step", "time",
    "test_accuracy"}``). An evaluation at step s ran between step s's record and its own record; the
    training clock at it is step s's time minus every earlier evaluation's duration.

    >>> training_clock([{"step": 1, "time": 1.0}, {"step": 2, "time": 4.0}],
    ...                [{"step": 1, "time": 2.0, "test_accuracy": 0.5},
    ...                 {"step": 2, "time": 5.0, "test_accuracy": 0.9}])
    [(1.0, 0.5), (3.0, 0.9)]
    """
    step_time = {r["step"]: r["time"] for r in steps if "time" in r}
    out, spent = [], 0.0
    for e in evals:
        acc = e.get(f"test_{metric}")
        t_step = step_time.get(e["step"])
        if acc is None or t_step is None:
            continue
        out.append((t_step - spent, float(acc)))
        spent += max(0.0, e["time"] - t_step)
    return out


def first_crossing(points: list[tuple[float, float]], target: float | Target) -> float | None:
    """Training seconds at the first evaluation that reaches ``target`` (a number: accuracy at or above
    it); None if never."""
    goal = target if isinstance(target, Target) else Target.of("accuracy", target)
    return goal.first(points)


def median_time(times: list[float | None]) -> float | None:
    """Median over seeds, a missed target counting as infinitely slow; None if the median missed."""
    if not times:
        return None
    ordered = sorted(times, key=lambda t: float("inf") if t is None else t)
    n = len(ordered)
    lo, hi = ordered[(n - 1) // 2], ordered[n // 2]
    if lo is None or hi is None:
        return None
    return statistics.mean([lo, hi])


def best_vs_baseline(medians: dict[str, float | None], baseline: str) -> tuple[str | None, float | None]:
    """(the fastest setup other than ``baseline``, its median time / the baseline's), None where missing.

    >>> best_vs_baseline({"allreduce": 10.0, "easgd": 4.0, "downpour": None}, "allreduce")
    ('easgd', 0.4)
    """
    others = {k: v for k, v in medians.items() if k != baseline and v is not None}
    if not others:
        return None, None
    best = min(others, key=others.get)
    base = medians.get(baseline)
    return best, (others[best] / base if base else None)


# -- the study -------------------------------------------------------------------------------------


def default_setups() -> list[str]:
    """Every strategy setup of ``bench cluster`` (a strategy added there joins with its one line)."""
    from parambox.bench.cluster import SETUPS

    return [name for name, s in SETUPS.items() if s.strategy is not None]


def plan(
    base: dict[str, Any], setups: list[str], gbps: list[float | None], seeds: list[int], nodes: int
) -> list[PlannedRun]:
    """One run per (link rate, setup, seed), validated up front. ``None`` in ``gbps``: loopback."""
    from parambox.bench.cluster import SETUPS, Setup

    unknown = [s for s in setups if (s not in SETUPS or SETUPS[s].strategy is None) and s not in STRATEGIES]
    if unknown:
        raise UserError(
            f"time to accuracy: unknown setups {unknown}; choose from {', '.join(default_setups())} or "
            "a strategy's name (its defaults)"
        )
    planned = []
    for g in gbps:
        cluster = {"nodes": nodes, "link_gbps": g} if g is not None else None
        for name in setups:
            setup = SETUPS.get(name) or Setup(f"{name} (defaults)", strategy=name)
            for seed in seeds:
                cfg = merge(base, setup.train_config())
                if cfg["box"].get("backend") == "rma":
                    # Every setup on the same processes, also on loopback: the box sharded over the
                    # workers (an asynchronous strategy would get a memory rank there,
                    # AsyncStrategy.memory_ranks), as bench cluster runs it.
                    cfg["box"] = {"memory_ranks": 0, **cfg["box"]}
                cfg = merge(cfg, {"seed": seed, "lr": lr_for(setup.strategy, base["lr"], base["workers"])})
                cfg = merge(cfg, method_optimizer(setup.strategy))
                if cluster:
                    cfg["cluster"] = cluster
                validate(cfg)
                tag = "loopback" if g is None else f"{g:g}gbps"
                planned.append(PlannedRun(f"{tag}-{name}-s{seed}", cfg))
    return planned


def describe(p: PlannedRun, outcome, target: Target) -> dict[str, Any]:
    """One run: its target metric's curve on the training clock, time to target, final value."""
    from parambox.report import load_run

    rec: dict[str, Any] = {"name": p.name, "run_dir": str(outcome.run_dir), "seed": p.config["seed"]}
    rec["lr"] = p.config["lr"]
    if outcome.error:
        return rec | {"status": "failed", "reason": outcome.error, "time_to_target_s": None}
    run = load_run(outcome.run_dir)
    lead = clock_lead(outcome.run_dir)
    metric = target.metric
    points = [(t + lead, acc) for t, acc in training_clock(run.steps, run.evals, metric)]
    gaps = [b[0] - a[0] for a, b in zip(points, points[1:])]
    return rec | {
        "status": "ok",
        "curve": points,
        "time_to_target_s": first_crossing(points, target),
        "eval_granularity_s": statistics.median(gaps) if gaps else None,
        "final_test_accuracy": run.summary.get(f"final_test_{metric}"),
        "samples_per_s": run.summary.get("samples_per_s"),
    }


def run_time_to_accuracy(
    out: str | Path,
    base: dict[str, Any],
    setups: list[str] | None = None,
    gbps: list[float | None] | None = None,
    seeds: list[int] | None = None,
    target: float | Target = 0.98,
    nodes: int = 2,
    baseline: str = "allreduce",
    run_timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run (or resume) the study in ``out``; write results.json, table.md and time_to_accuracy.png.

    ``base``: a run config (workers, model, data, steps, lr, eval_every, ...); every setup trains it
    with its own strategy, its ``lr_for`` rate and each seed, until ``target`` (a number: test accuracy at or
    above it; or a :class:`Target`, e.g. perplexity at or under 12). Returns, per link rate, each setup's
    median time (``median_s``), ``best_setup`` and ``best_vs_baseline`` (median time / the baseline's).

    >>> run_time_to_accuracy("tta", preset("time-to-accuracy"), gbps=[1.0, 0.1])  # doctest: +SKIP
    """
    out = Path(out)
    goal = target if isinstance(target, Target) else Target.of(base.get("target_metric", "accuracy"), target)
    base = {**base, "target_metric": goal.metric}
    setups = setups or default_setups()
    gbps = gbps if gbps is not None else [1.0, 0.1]
    seeds = seeds if seeds is not None else [0, 1, 2]
    if any(g is not None for g in gbps):
        from parambox.runtime.cluster import check_environment

        check_environment()
    planned = plan(base, setups, gbps, seeds, nodes)
    outcomes = ensure_runs(planned, out / "runs", run_timeout_s)
    runs = [describe(p, o, goal) for p, o in zip(planned, outcomes)]
    results: dict[str, Any] = {
        "study": "time-to-accuracy",
        "model": base.get("model"),
        "data": base.get("data"),
        "workers": base["workers"],
        "nodes": nodes,
        "target_accuracy": None if goal.lower_is_better else goal.value,  # kept: its value, where it rises
        "target": goal.as_json(),
        "seeds": seeds,
        "baseline": baseline,
        "base_lr": base["lr"],
        "lr_rule": "base lr; lr / workers for "
        + ", ".join(sorted(n for n in STRATEGIES if strategy_class(n).shared_center))
        + "; "
        + "; ".join(f"{n}: {method_optimizer(n)}" for n in STRATEGIES if method_optimizer(n)),
        "eval_every": base.get("eval_every"),
        "by_gbps": {},
    }
    it = iter(runs)
    for g in gbps:
        entry: dict[str, Any] = {"setups": {}}
        for name in setups:
            rs = [next(it) for _ in seeds]
            times = [r["time_to_target_s"] for r in rs]
            grains = [r["eval_granularity_s"] for r in rs if r.get("eval_granularity_s")]
            entry["setups"][name] = {
                "median_s": median_time(times),
                "times_s": times,
                "eval_granularity_s": statistics.median(grains) if grains else None,
                "lr": rs[0]["lr"],
                "runs": rs,
            }
        medians = {n: e["median_s"] for n, e in entry["setups"].items()}
        entry["best_setup"], entry["best_vs_baseline"] = best_vs_baseline(medians, baseline)
        results["by_gbps"]["loopback" if g is None else f"{g:g}"] = entry
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table_markdown(results))
    plot(results, out / "time_to_accuracy.png")
    return results


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["link (Gbit/s)", "setup", "lr", "median time (s)", "per seed (s)", "eval granularity (s)"]
    rows = []

    def num(x):
        return "not reached" if x is None else f"{x:.1f}"

    for g, entry in results["by_gbps"].items():
        for name, e in entry["setups"].items():
            grain = e["eval_granularity_s"]
            rows.append(
                [g, name, f"{e['lr']:g}", num(e["median_s"]), ", ".join(num(t) for t in e["times_s"])]
                + ["-" if grain is None else f"{grain:.2f}"]
            )
    return header, rows


def table_markdown(results: dict[str, Any]) -> str:
    from parambox.report.page import markdown_table

    header, rows = table_rows(results)
    lines = [
        f"# Time to {target_label(results)}: {results['model']} on "
        f"{results['data']}, {results['workers']} workers "
        + (
            "on loopback"
            if list(results["by_gbps"]) == ["loopback"]
            else f"on {results['nodes']} emulated nodes"
        ),
        "",
        f"Median of seeds {results['seeds']}; training seconds (evaluations excluded) until the first "
        f"evaluation that reaches the target. Learning rates: {results['lr_rule']}.",
        "",
        markdown_table(header, rows),
        "",
    ]
    for g, entry in results["by_gbps"].items():
        ratio = entry["best_vs_baseline"]
        lines.append(
            f"- {g if g == 'loopback' else g + ' Gbit/s'}: best {entry['best_setup']}, "
            + ("-" if ratio is None else f"{ratio:.2f}x {results['baseline']}'s time")
        )
    return "\n".join(lines) + "\n"


def target_label(results: dict[str, Any]) -> str:
    """``98 % test accuracy``, or ``test perplexity <= 12`` for a target of another metric.

    >>> target_label({"target_accuracy": 0.98}), target_label({"target": Target.of("perplexity", 12).as_json()})
    ('98 % test accuracy', 'test perplexity <= 12')
    """
    t = results.get("target")
    if t is None or (t["metric"] == "accuracy" and not t["lower_is_better"]):
        return f"{100 * results['target_accuracy']:g} % test accuracy"
    return f"test {Target(**t)}"


def plot(results: dict[str, Any], path: Path) -> Path:
    """Median time to target per setup, one group of bars per link rate (missed targets: no bar, 'x')."""
    from parambox.report.plots import plt, save_figure

    links = list(results["by_gbps"])
    names = list(next(iter(results["by_gbps"].values()))["setups"]) if links else []
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names) * len(links)), 4.2))
    width = 0.8 / max(1, len(links))
    for i, g in enumerate(links):
        medians = [results["by_gbps"][g]["setups"][n]["median_s"] for n in names]
        xs = [k + i * width for k in range(len(names))]
        ax.bar(xs, [m or 0.0 for m in medians], width, label=f"{g} Gbit/s")
        for x, m in zip(xs, medians):
            if m is None:
                ax.text(x, 0, "x", ha="center", va="bottom", color="tab:red")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, rotation=30, fontsize=8)
    ax.set_ylabel(f"training seconds to {target_label(results)} (median)", fontsize=8)
    ax.set_title(f"Time to target, {results['model']} on {results['data']} (x: not reached)", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
