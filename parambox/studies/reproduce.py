"""``parambox reproduce --out DIR [--quick] [--only ID,...]``: every quantitative claim of the seeds
(issue 11 item 4), re-measured at a size this machine takes, each with a verdict and a figure.

Each claim is one entry of ``CLAIMS``: what the seed says, where (seed file, figure or section), a
``measure`` function that runs the measurement (mostly an existing parambox command, run as a user runs
it, whose output it reads) and a ``verdict`` function, pure, from the measured numbers to
``reproduced`` | ``partly`` | ``not reproduced`` and one line saying why (unit-tested on given numbers).
A claim that needs the emulated cluster (root) is ``skipped`` with a note when not root; a claim left
out by ``--only`` or whose measurement failed is ``skipped`` too, with the reason.

Writes ``DIR/claims.json`` (``claims``: a list of {id, claim, source, run, measured, verdict, why,
plot}), ``DIR/index.html`` and ``DIR/index.md`` (the table and every claim's figure), and each
claim's own files under ``DIR/<id>/`` (the runs of the studies there are reused when run again with
the same DIR: a rerun resumes). ``--quick`` is the same with tiny measurements, for the test suite:
its verdicts check the machinery, not the seeds.

>>> run_reproduce("repro", quick=True, only=["neuron"])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.studies import simulated as sim
from parambox.workload.targets import Target

VERDICTS = ("reproduced", "partly", "not reproduced")
SKIPPED = "skipped"
SEED_SHM_LEARN = "001_a29e8a1726cc7be0.txt (SHM-Learn-Dist report)"
SEED_SURVEY = "000_937db5eebaf763a1.txt (survey of distributed deep learning on HPC)"
SEED_SLIDES = "002_7e5ab6fb90c8a4db.txt (slides: HPC and deep learning, Keuper & Pfreundt)"
SEED_LERAT = "003_cf64f1aa9638993a.txt (Lerat et al., local parallelism)"
MARGIN_PTS = 1.0  # accuracy points within which two runs count as equal (small test sets, one seed)
WORKLOAD_CLAIMS = ("tau-h",)  # the claims --model/--data/--target apply to: the time-to-target one
TAUS = (1, 4, 16, 64)
TAU_METHODS = ("easgd", "eamsgd", "downpour")


class MeasureFailed(Exception):
    """A claim's measurement did not complete; its message is one line."""


@dataclass
class Ctx:
    out: Path
    quick: bool
    root: bool
    # The time-to-target claim's workload and target (``--model``/``--data``/``--target``): its runs train
    # this model on this data until this test metric; empty: the claim's own (LeNet, accuracy 98 %).
    workload: dict[str, str] = field(default_factory=dict)
    target: Target | None = None

    def dir(self, claim_id: str) -> Path:
        d = self.out / claim_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def self_command(self, claim_id: str) -> str:
        cmd = f"parambox reproduce --out {self.out}{' --quick' if self.quick else ''} --only {claim_id}"
        if claim_id in WORKLOAD_CLAIMS:
            cmd += "".join(f" --{k.replace('_', '-')} {v}" for k, v in self.workload.items())
            cmd += f" --target {self.target.metric}={self.target.value:g}" if self.target else ""
        return cmd


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    source: str
    measure: Callable[[Ctx], tuple[str, dict[str, Any], str | None]]  # -> (run, measured, plot)
    verdict: Callable[[dict[str, Any]], tuple[str, str]]  # measured -> (verdict, why)
    needs_root: bool = False


# -- running parambox as a user runs it ------------------------------------------------------------


def cli(args: list[str], timeout_s: float = 1500.0) -> str:
    """``parambox ARGS`` in a subprocess; its stdout, or MeasureFailed with its last error line."""
    cmd = [sys.executable, "-m", "parambox", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        raise MeasureFailed(f"parambox {args[0]} ran past {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or [f"exit code {proc.returncode}"]
        raise MeasureFailed(f"parambox {' '.join(args[:2])}: {lines[-1][:300]}")
    return proc.stdout


def shown(args: list[str]) -> str:
    return "parambox " + " ".join(args)


def _rel(ctx: Ctx, path: Path) -> str | None:
    return str(path.relative_to(ctx.out)) if path.exists() else None


# -- helpers of the verdicts -----------------------------------------------------------------------


def strictly_decreasing(xs: list[float]) -> bool:
    return all(a > b for a, b in zip(xs, xs[1:]))


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, R^2) of the least-squares line through (xs, ys).

    >>> linear_fit([1, 2, 3], [2, 4, 6])
    (2.0, 1.0)
    """
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, (1.0 - ss_res / ss_tot) if ss_tot else 1.0


def by_count(held: int, total: int) -> str:
    """reproduced if every part holds, partly if some, not reproduced if none."""
    return "reproduced" if held == total else "partly" if held else "not reproduced"


# -- 1. more workers: slower convergence, smoother loss (SHM-Learn-Dist §3, Fig. 2.1) --------------


def measure_neuron(ctx: Ctx):
    d = ctx.dir("neuron")
    steps = 200 if ctx.quick else 4000
    args = ["sweep", "--study", "neuron", "--workers", "2,4,8,16", "--steps", str(steps)]
    args += ["--no-cross-check", "--out", str(d)]
    cli(args)
    res = json.loads((d / "results.json").read_text())
    per_n = res["schemes"]["gradient-averaged"]
    measured = {
        "scheme": "gradient-averaged",
        "steps_per_worker": steps,
        "workers": [int(n) for n in per_n],
        "roughness": [per_n[n]["roughness"] for n in per_n],
        "final_loss": [per_n[n]["final_loss"] for n in per_n],
    }
    return shown(args), measured, _rel(ctx, d / "loss_curves.png")


def verdict_neuron(m: dict[str, Any]) -> tuple[str, str]:
    """Smoother: roughness strictly decreasing with workers. Slower: final loss (mean of the last 10 %
    of the steps) not decreasing with workers (at equal steps per worker)."""
    smoother = strictly_decreasing(m["roughness"])
    loss = m["final_loss"]
    slower = all(b >= a for a, b in zip(loss, loss[1:]))
    why = (
        f"roughness {'decreases' if smoother else 'does not decrease'} with workers; final loss "
        f"{'does not fall' if slower else 'falls'} with workers ({', '.join(f'{x:.3g}' for x in loss)})"
    )
    return by_count(smoother + slower, 2), why


# -- 2. the best (batch, lr) per worker count by the loss-area metric (§5, Table 5.1) --------------


def measure_grid(ctx: Ctx):
    d = ctx.dir("grid")
    if ctx.quick:
        grid = ["--workers", "1", "--batch-size", "16", "--lr", "0.1", "--samples", "320"]
    else:
        grid = ["--workers", "1,2", "--batch-size", "16,32", "--lr", "0.05,0.1,0.2", "--samples", "6144"]
    args = ["sweep", *grid, "--out", str(d)]
    cli(args)
    res = json.loads((d / "results.json").read_text())
    winners = {
        n: (None if w is None else {"batch_size": w["batch_size"], "lr": w["lr"], "area": w["area"]})
        for n, w in res["winners"].items()
    }
    measured = {
        "winners": winners,
        "runs": len(res["runs"]),
        "qualified": sum(r["status"] == "ok" for r in res["runs"]),
        "diverged": sum(r["status"] == "diverged" for r in res["runs"]),
    }
    return shown(args), measured, _rel(ctx, d / f"heatmap_workers{next(iter(winners))}.png")


def verdict_grid(m: dict[str, Any]) -> tuple[str, str]:
    """The metric picks a best (batch, lr) for every worker count (the table's existence), and, as in
    Table 5.1 (128, 128, 128, 64), the winning per-worker batch does not grow with workers."""
    winners = m["winners"]
    found = [w for w in winners.values() if w is not None]
    if not found:
        return "not reproduced", "no run reached the loss threshold"
    every = len(found) == len(winners)
    batches = [w["batch_size"] for w in winners.values() if w is not None]
    trend = all(b <= a for a, b in zip(batches, batches[1:]))
    text = "; ".join(
        f"{n} worker(s): " + ("none" if w is None else f"batch {w['batch_size']}, lr {w['lr']:g}")
        for n, w in winners.items()
    )
    return by_count(every + trend, 2), f"{text}; per-worker batch {'not growing' if trend else 'grows'}"


# -- 3 and 4. the parameter server's phases and accuracy per time (§6, Figs. 6.3-6.6) -------------


def measure_scaling(ctx: Ctx) -> tuple[str, dict[str, Any]]:
    """The scaling study once for claims 3 and 4 (cached in the context's directory)."""
    d = ctx.dir("scaling")
    workers, samples = ("1,2", "320") if ctx.quick else ("1,2,3,4", "12288")
    args = ["sweep", "--study", "scaling", "--workers", workers, "--samples", samples, "--out", str(d)]
    if not (d / "results.json").exists() or json.loads((d / "results.json").read_text())["workers"] != [
        int(w) for w in workers.split(",")
    ]:
        cli(args)
    return shown(args), json.loads((d / "results.json").read_text())


def measure_phases(ctx: Ctx):
    run, res = measure_scaling(ctx)
    phases = ("average", "gather", "broadcast")
    ok = [r for r in res["runs"] if r["status"] == "ok" and all(ph in r["comm_ms_per_step"] for ph in phases)]
    measured = {
        "workers": [r["workers"] for r in ok],
        "ms_per_step": {ph: [r["comm_ms_per_step"].get(ph) for r in ok] for ph in phases},
        "oversubscribed": res["oversubscribed"],
        "cores": res["cores"],
    }
    return run, measured, _rel(ctx, ctx.out / "scaling" / "comm_phases.png")


def verdict_phases(m: dict[str, Any]) -> tuple[str, str]:
    """Averaging linear in workers (slope > 0, R^2 >= 0.9 over >= 2 counts); gather or broadcast
    irregular (not monotone in workers, or R^2 < 0.9 of a line)."""
    xs, ms = m["workers"], m["ms_per_step"]
    if len(xs) < 2 or any(v is None for ph in ms.values() for v in ph):
        return "not reproduced", "fewer than two worker counts with all three phases timed"
    slope, r2 = linear_fit(xs, ms["average"])
    linear = slope > 0 and r2 >= 0.9

    def irregular(ys: list[float]) -> bool:
        up = all(b >= a for a, b in zip(ys, ys[1:]))
        down = all(b <= a for a, b in zip(ys, ys[1:]))
        return not (up or down) or (len(ys) > 2 and linear_fit(xs, ys)[1] < 0.9)

    odd = [ph for ph in ("gather", "broadcast") if irregular(ms[ph])]
    why = f"average: slope {slope:.3g} ms/worker, R^2 {r2:.2f}; irregular: {', '.join(odd) or 'none'}" + (
        " (only 2 worker counts: regularity untestable)" if len(xs) < 3 else ""
    )
    return by_count(linear + bool(odd), 2), why


def measure_gain(ctx: Ctx):
    run, res = measure_scaling(ctx)
    ok = [r for r in res["runs"] if r["status"] == "ok"]
    measured = {
        "workers": [r["workers"] for r in ok],
        "final_test_accuracy": [r["final_test_accuracy"] for r in ok],
        "train_time_s": [r["wall_time_s"] for r in ok],
        "accuracy_pts_per_s": [100 * r["final_test_accuracy"] / r["wall_time_s"] for r in ok],
        "oversubscribed": res["oversubscribed"],
    }
    return run, measured, _rel(ctx, ctx.out / "scaling" / "accuracy_ps-sync.png")


def verdict_gain(m: dict[str, Any]) -> tuple[str, str]:
    """Accuracy points per training second (same samples) peak at a worker count strictly between the
    smallest and the largest; at the largest: partly (the peak lies beyond the counts measured)."""
    xs, gain = m["workers"], m["accuracy_pts_per_s"]
    if len(xs) < 2:
        return "not reproduced", "fewer than two worker counts"
    best = xs[gain.index(max(gain))]
    text = ", ".join(f"{n}: {g:.2f}" for n, g in zip(xs, gain))
    why = f"accuracy points per second by workers {text}; peak at {best}"
    if min(xs) < best < max(xs):
        return "reproduced", why
    return ("partly" if best == max(xs) else "not reproduced"), why


# -- 5. ShmCaffe-H (sync in a node, async across) loses fewer points than ShmCaffe (pure async) -----


def _train_runs(ctx: Ctx, claim_id: str, planned: list) -> list[dict[str, Any]]:
    """``parambox train`` runs (resumable) -> [{name, final_test_accuracy, wall_time_s}] or MeasureFailed."""
    from parambox.report import load_run
    from parambox.studies.runs import ensure_runs

    outcomes = ensure_runs(planned, ctx.dir(claim_id) / "runs", 900.0, echo=False)
    failed = [o for o in outcomes if o.error]
    if failed:
        raise MeasureFailed(f"{failed[0].name}: {failed[0].error}")
    rows = []
    for o in outcomes:
        s = load_run(o.run_dir).summary
        rows.append(
            {
                "name": o.name,
                "final_test_accuracy": s.get("final_test_accuracy"),
                "wall_time_s": s.get("wall_time_s"),
            }
        )
    return rows


def _digits_base(workers: int, steps: int) -> dict[str, Any]:
    from parambox.presets import preset

    return {**preset("digits-allreduce"), "workers": workers, "steps": steps, "threads": 1, "eval_every": 0}


def measure_hybrid(ctx: Ctx):
    from parambox.config import merge
    from parambox.studies.accuracy import lr_for
    from parambox.studies.runs import PlannedRun

    steps = 10 if ctx.quick else 150
    base = _digits_base(4, steps)
    setups = {
        "allreduce": {"strategy": "allreduce"},
        "hybrid": {"strategy": "hybrid", "options": {"hybrid": {"group_size": 2, "tau": 4}}},
        "easgd": {"strategy": "easgd", "options": {"easgd": {"tau": 4}}},
    }
    seeds = [0] if ctx.quick else [0, 1]
    planned = [
        PlannedRun(
            f"{name}-s{seed}", merge(base, {**s, "seed": seed, "lr": lr_for(s["strategy"], base["lr"], 4)})
        )
        for name, s in setups.items()
        for seed in seeds
    ]
    rows = _train_runs(ctx, "hybrid", planned)
    acc = {
        name: statistics.mean(r["final_test_accuracy"] for r in rows if r["name"].startswith(name + "-"))
        for name in setups
    }
    measured = {
        "workers": 4,
        "groups": "2 synchronous groups of 2 (ShmCaffe-H's nodes; on loopback), EASGD tau 4 between them",
        "steps": steps,
        "seeds": seeds,
        "final_test_accuracy": acc,
        "points_lost_vs_allreduce": {n: 100 * (acc["allreduce"] - acc[n]) for n in ("hybrid", "easgd")},
    }
    plot = _bars(
        ctx.dir("hybrid") / "accuracy.png",
        {k: 100 * v for k, v in acc.items()},
        "final test accuracy (%)",
        f"LeNet/digits, 4 workers, {steps} steps: sync, hybrid (ShmCaffe-H), async EASGD (ShmCaffe)",
    )
    return ctx.self_command("hybrid"), measured, _rel(ctx, plot)


def verdict_hybrid(m: dict[str, Any]) -> tuple[str, str]:
    """Hybrid loses fewer accuracy points than pure async: by more than MARGIN_PTS reproduced, within
    the margin partly (not distinguishable at this size), else not reproduced."""
    lost = m["points_lost_vs_allreduce"]
    diff = lost["easgd"] - lost["hybrid"]
    why = f"points lost vs allreduce: hybrid {lost['hybrid']:.2f}, pure async {lost['easgd']:.2f}"
    if diff > MARGIN_PTS:
        return "reproduced", why
    return ("partly" if diff >= -MARGIN_PTS else "not reproduced"), why


# -- 6. EASGD holds at large tau where Downpour degrades; EAMSGD best (the EASGD paper's tau study) -


def measure_tau(ctx: Ctx):
    from parambox.config import merge
    from parambox.strategies import strategy_class
    from parambox.studies.accuracy import lr_for
    from parambox.studies.runs import PlannedRun

    taus = (1, 4) if ctx.quick else TAUS
    steps = 8 if ctx.quick else 640  # 10 exchanges at tau 64
    base = _digits_base(2, steps)
    planned = []
    for method in TAU_METHODS:
        # As in the paper: EASGD and Downpour step plain SGD (lr 0.1, digits-sweep's), EAMSGD Nesterov
        # momentum 0.9 (lr 0.03, the default run's: about the same step once momentum has built up).
        lr, momentum = (0.03, 0.9) if method == "eamsgd" else (0.1, 0.0)
        for tau in taus:
            opts = dict.fromkeys(strategy_class(method).period_options, tau)
            cfg = {
                "strategy": method,
                "options": {method: opts},
                "lr": lr_for(method, lr, 2),
                "momentum": momentum,
            }
            planned.append(PlannedRun(f"{method}-tau{tau}", merge(base, cfg)))
    rows = {r["name"]: r for r in _train_runs(ctx, "easgd-tau", planned)}
    table = {m: {str(t): 100 * rows[f"{m}-tau{t}"]["final_test_accuracy"] for t in taus} for m in TAU_METHODS}
    measured = {
        "taus": list(taus),
        "steps": steps,
        "workers": 2,
        "lr": {p.name.split("-tau")[0]: p.config["lr"] for p in planned},
        "test_accuracy_pct": table,
    }
    plot = _tau_plot(ctx.dir("easgd-tau") / "tau.png", table, taus, steps)
    return ctx.self_command("easgd-tau"), measured, _rel(ctx, plot)


def verdict_tau(m: dict[str, Any]) -> tuple[str, str]:
    """Three parts: EASGD holds (accuracy at the largest tau within MARGIN_PTS of its best); Downpour
    degrades (its largest-tau accuracy more than MARGIN_PTS below its best, or below EASGD's by more
    than the margin); EAMSGD best (within the margin of the best method at every tau but at most one)."""
    acc, taus = m["test_accuracy_pct"], [str(t) for t in m["taus"]]
    big = taus[-1]
    holds = acc["easgd"][big] >= max(acc["easgd"].values()) - MARGIN_PTS
    degrades = (
        acc["downpour"][big] < max(acc["downpour"].values()) - MARGIN_PTS
        or acc["downpour"][big] < acc["easgd"][big] - MARGIN_PTS
    )
    best_at = [t for t in taus if acc["eamsgd"][t] >= max(acc[x][t] for x in acc) - MARGIN_PTS]
    eamsgd_best = len(best_at) >= len(taus) - 1
    why = (
        f"tau {big}: easgd {acc['easgd'][big]:.1f} %, downpour {acc['downpour'][big]:.1f} %, eamsgd "
        f"{acc['eamsgd'][big]:.1f} %; easgd {'holds' if holds else 'drops'}, downpour "
        f"{'degrades' if degrades else 'holds'}; eamsgd best at tau {', '.join(best_at) or 'none'}"
    )
    return by_count(holds + degrades + eamsgd_best, 3), why


# -- 7. a shared buffer communicates >= 2x faster than MPI message passing (SMB) -------------------


def measure_smb(ctx: Ctx):
    if ctx.quick:
        from parambox.bench.box import run_bench_box

        res, run = run_bench_box(json_out=True, sizes_mb=(1,), repeats=1), ctx.self_command("smb")
    else:
        args = ["bench", "box", "--json", "--rounds", "5"]
        res, run = json.loads(cli(args)), shown(args)
    ops, top = res["ops"], str(max(res["sizes_mb"]))
    if "mpi_allreduce" not in ops or "shm_push" not in ops:
        raise MeasureFailed(f"bench box: no MPI figures ({res.get('errors')})")
    shm_ms = ops["shm_push"][top]["ms"] + ops["shm_pull"][top]["ms"]
    measured = {
        "size_mb": int(top),
        "shm_push_plus_pull_ms": shm_ms,
        "mpi_allreduce_ms": ops["mpi_allreduce"][top]["ms"],
        "speedup": ops["mpi_allreduce"][top]["ms"] / shm_ms,
    }
    if "rma_tcp_push" in ops and "mpi_allreduce_tcp" in ops:
        tcp_ms = ops["rma_tcp_push"][top]["ms"] + ops["rma_tcp_pull"][top]["ms"]
        measured["tcp_speedup"] = ops["mpi_allreduce_tcp"][top]["ms"] / tcp_ms
    measured["across_link"], link_run = _smb_across_link(ctx)
    run = f"{run}; {link_run}" if link_run else run
    plot = _bars(
        ctx.dir("smb") / "smb.png",
        {"shm box push + pull": shm_ms, "MPI_Allreduce": measured["mpi_allreduce_ms"]},
        f"ms per exchange of {top} MiB",
        "one worker's exchange: the shared buffer against MPI message passing (2 processes)",
    )
    return run, measured, _rel(ctx, plot)


SMB_LINK_GBPS = 1.0


def _smb_across_link(ctx: Ctx) -> tuple[dict[str, Any] | None, str | None]:
    """The claim across an emulated link (``bench box --emulate-nodes 2``): the memory server's
    fused push-pull against ``MPI_Allreduce`` of the same bytes between the two nodes. Needs root
    (network namespaces); the quick form leaves it out (it would hold the machine's one cluster)."""
    if ctx.quick or not ctx.root:
        return {"skipped": "the quick form" if ctx.quick else "needs root (an emulated cluster)"}, None
    args = ["bench", "box", "--emulate-nodes", "2", "--link-gbps", f"{SMB_LINK_GBPS:g}", "--json"]
    res = json.loads(cli(args))
    key = "server_push_pull_fused_vs_mpi_allreduce"
    if key not in res:
        raise MeasureFailed(f"bench box across the link: no {key}")
    size = res["size_mb"]
    return {
        "link_gbps": SMB_LINK_GBPS,
        "size_mb": size,
        "box_push_pull_ms": res["ops"]["server_push_pull_fused"]["ms"],
        "mpi_allreduce_ms": res["ops"]["mpi_allreduce"]["ms"],
        "speedup": res[key],
    }, shown(args)


def _smb_part(speedup: float) -> str:
    return "reproduced" if speedup >= 2 else "partly" if speedup >= 1.2 else "not reproduced"


def verdict_smb(m: dict[str, Any]) -> tuple[str, str]:
    """MPI allreduce time / box push+pull time, on one node and across an emulated link, each: >= 2
    reproduced, >= 1.2 partly (faster, less than 2x). Both the same: that verdict; else partly, or
    the one node's where the link was not measured."""
    one = _smb_part(m["speedup"])
    why = (
        f"one node: the box exchanges {m['size_mb']} MiB {m['speedup']:.2f}x as fast as MPI_Allreduce ({one})"
    )
    link = m.get("across_link") or {"skipped": "not measured"}
    if "speedup" not in link:
        return one, f"{why}; across a link: not measured ({link['skipped']})"
    two = _smb_part(link["speedup"])
    why += (
        f"; across a {link['link_gbps']:g} Gbit/s link: the memory server's push-pull of "
        f"{link['size_mb']} MiB {link['speedup']:.2f}x as fast as MPI_Allreduce ({two})"
    )
    return (one if one == two else "partly"), why


# -- 8. on a CPU, multi-process data parallelism beats multi-threading and model parallelism -------


def measure_lerat(ctx: Ctx):
    if ctx.quick:
        from parambox.bench.local import run_bench_local

        res = run_bench_local(steps=2, setups=["sequential", "threads", "allreduce", "pipeline"])
        run = ctx.self_command("lerat")
    else:
        args = ["bench", "local", "--json", "--rounds", "2", "--steps", "60"]
        res, run = json.loads(cli(args)), shown(args)
    sp = res["speedups"]
    measured = {"speedups": sp, "cores": res["cores"], "steps": res["steps"]}
    plot = _bars(ctx.dir("lerat") / "speedups.png", sp, "speedup over 1 process x 1 thread", "bench local")
    return run, measured, _rel(ctx, plot)


def verdict_lerat(m: dict[str, Any]) -> tuple[str, str]:
    """The best multi-process data-parallel setup (allreduce, box-sync) beats threads and beats the best
    model-parallel one (pipeline, pipeline-dp): both reproduced, one partly."""
    sp = m["speedups"]
    dp = max((sp[k] for k in ("allreduce", "box-sync") if k in sp), default=0.0)
    threads = sp.get("threads", 0.0)
    mp = max((sp[k] for k in ("pipeline", "pipeline-dp") if k in sp), default=0.0)
    why = f"speedups: data parallel {dp:.2f}, threads {threads:.2f}, model parallel {mp:.2f}"
    return by_count((dp > threads) + (dp > mp), 2), why


# -- 9. data-parallel speedup is communication bound and peaks at a few dozen nodes ----------------


def predict_model_args(quick: bool) -> list[str]:
    """The model ``predict`` measures for the Keuper claims: alexnet, or LeNet in the quick form."""
    if quick:
        return ["--model", "lenet", "--input-shape", "1,28,28", "--repeats", "1", "--max-measure-batch", "16"]
    return ["--model", "alexnet", "--repeats", "3", "--max-measure-batch", "128"]


def measure_keuper(ctx: Ctx):
    d = ctx.dir("keuper")
    args = ["predict", "--json", "--emulate-nodes", "2", "--link-gbps", "1", "--validate", "--out", str(d)]
    args += predict_model_args(ctx.quick)
    res = json.loads(cli(args))
    measured = {
        "model": "lenet" if ctx.quick else "alexnet",
        "link_gbps": 1.0,
        "global_batch": res.get("global_batch", 1024),
        "n_peak": res["n_peak"],
        "validation_max_rel_error": res.get("validation_max_rel_error"),
    }
    return shown(args), measured, _rel(ctx, d / "predict.png")


def verdict_keuper(m: dict[str, Any]) -> tuple[str, str]:
    """Two parts: the ring allreduce's predicted speedup peaks at 8..128 workers ("a few dozen") on the
    measured 1 Gbit/s link; the model holds on the emulated cluster (validation error <= 25 %)."""
    n_peak = m["n_peak"].get("ring")
    peaks = n_peak is not None and 8 <= n_peak <= 128
    err = m["validation_max_rel_error"]
    valid = err is not None and err <= 0.25
    why = f"ring n_peak {n_peak} at {m['link_gbps']:g} Gbit/s; prediction error on the cluster " + (
        "-" if err is None else f"{100 * err:.0f} %"
    )
    return by_count(peaks + valid, 2), why


# -- figures ---------------------------------------------------------------------------------------


def _bars(path: Path, values: dict[str, float], ylabel: str, title: str) -> Path:
    from parambox.report.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(values) + 2), 3.8))
    ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    return save_figure(fig, path)


def _tau_plot(path: Path, table: dict[str, dict[str, float]], taus, steps: int) -> Path:
    from parambox.report.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, acc in table.items():
        ax.plot(list(taus), [acc[str(t)] for t in taus], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tau (local steps between exchanges)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"LeNet/digits, 2 workers, {steps} steps: the EASGD paper's tau study", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


# -- the claims ------------------------------------------------------------------------------------

CLAIMS: list[Claim] = [
    Claim(
        "neuron",
        "more workers converge slower but with a smoother loss",
        f"{SEED_SHM_LEARN} §3, Fig. 2.1",
        measure_neuron,
        verdict_neuron,
    ),
    Claim(
        "grid",
        "the best (batch, lr) per worker count by the thresholded loss-area metric",
        f"{SEED_SHM_LEARN} §5, Table 5.1",
        measure_grid,
        verdict_grid,
    ),
    Claim(
        "phases",
        "gradient-averaging time grows linearly with workers; gather and broadcast times are irregular",
        f"{SEED_SHM_LEARN} §6, Figs. 6.4-6.6",
        measure_phases,
        verdict_phases,
    ),
    Claim(
        "gain",
        "accuracy gained per unit time peaks at a middle worker count",
        f"{SEED_SHM_LEARN} §6, Fig. 6.3",
        measure_gain,
        verdict_gain,
    ),
    Claim(
        "hybrid",
        "sync inside a node + async across (ShmCaffe-H) loses fewer accuracy points than pure async (ShmCaffe)",
        f"{SEED_SURVEY}, ShmCaffe / ShmCaffe-H",
        measure_hybrid,
        verdict_hybrid,
    ),
    Claim(
        "easgd-tau",
        "EASGD holds at large tau where Downpour degrades; EAMSGD best (tau in 1, 4, 16, 64)",
        f"{SEED_SURVEY}, EASGD (Zhang, Choromanska, LeCun)",
        measure_tau,
        verdict_tau,
    ),
    Claim(
        "smb",
        "a shared buffer communicates >= 2x faster than MPI message passing",
        f"{SEED_SURVEY}, Soft Memory Box (SMB)",
        measure_smb,
        verdict_smb,
    ),
    Claim(
        "lerat",
        "on a CPU, multi-process data parallelism beats multi-threading and model parallelism",
        f"{SEED_LERAT}, speedups against the sequential baseline",
        measure_lerat,
        verdict_lerat,
    ),
    Claim(
        "keuper",
        "data-parallel speedup is communication bound and peaks at a few dozen nodes",
        f"{SEED_SLIDES}, limits of scalability",
        measure_keuper,
        verdict_keuper,
        needs_root=True,
    ),
    # Simulated past this machine (studies/simulated.py): the simulator's check first, then the claims
    # two cores cannot host.
    Claim(
        "simulator",
        "the event simulator predicts each setup's step time on the emulated cluster within 15 %",
        "parambox's own: the simulated verdicts below rest on it",
        sim.measure_simulator,
        sim.verdict_simulator,
        needs_root=True,
    ),
    Claim(
        "phases-sim",
        "gradient-averaging time grows linearly with workers; gather and broadcast irregular (simulated, 1-64)",
        f"{SEED_SHM_LEARN} §6, Figs. 6.4-6.6",
        sim.measure_phases_sim,
        sim.verdict_phases_sim,
    ),
    Claim(
        "gain-sim",
        "accuracy gained per unit time peaks at a middle worker count (simulated, 1-32)",
        f"{SEED_SHM_LEARN} §6, Fig. 6.3",
        sim.measure_gain_sim,
        sim.verdict_gain_sim,
    ),
    Claim(
        "tau-h",
        "EASGD holds at large tau where Downpour degrades; EAMSGD best: with DiLoCo's H, on MNIST, and the "
        "time to 98 % at 1 and 0.1 Gbit/s (simulated time)",
        f"{SEED_SURVEY}, EASGD (Zhang, Choromanska, LeCun); DiLoCo",
        sim.measure_tau_h,
        sim.verdict_tau_h,
    ),
    Claim(
        "keuper-sim",
        "data-parallel speedup peaks at a few dozen nodes (simulated, 1-256)",
        f"{SEED_SLIDES}, limits of scalability",
        sim.measure_keuper_sim,
        sim.verdict_keuper_sim,
    ),
]


def claim_ids() -> list[str]:
    return [c.id for c in CLAIMS]


def assess(c: Claim, ctx: Ctx, selected: bool) -> dict[str, Any]:
    """One entry of claims.json."""
    entry: dict[str, Any] = {"id": c.id, "claim": c.claim, "source": c.source}
    if not selected:
        return entry | {
            "run": None,
            "measured": None,
            "verdict": SKIPPED,
            "why": "not in --only",
            "plot": None,
        }
    if c.needs_root and not ctx.root:
        why = "needs the emulated cluster: run as root"
        return entry | {"run": None, "measured": None, "verdict": SKIPPED, "why": why, "plot": None}
    try:
        run, measured, plot = c.measure(ctx)
    except (MeasureFailed, UserError) as e:
        why = f"measurement failed: {e}"
        return entry | {
            "run": ctx.self_command(c.id),
            "measured": None,
            "verdict": SKIPPED,
            "why": why,
            "plot": None,
        }
    except Exception as e:  # a bug in one claim's reading must not cost the others' results
        why = f"measurement failed: {type(e).__name__}: {e}"
        return entry | {
            "run": ctx.self_command(c.id),
            "measured": None,
            "verdict": SKIPPED,
            "why": why,
            "plot": None,
        }
    verdict, why = c.verdict(measured)
    assert verdict in VERDICTS, verdict
    return entry | {"run": run, "measured": measured, "verdict": verdict, "why": why, "plot": plot}


def run_reproduce(
    out: str | Path,
    quick: bool = False,
    only: list[str] | None = None,
    workload: dict[str, str] | None = None,
    target: Target | None = None,
) -> dict[str, Any]:
    """Measure the claims (``only``: these ids) into ``out``; write claims.json, index.md, index.html.
    ``workload`` (model, data, data_path) and ``target``: the time-to-target claim's (``WORKLOAD_CLAIMS``)."""
    out = Path(out)
    unknown = [i for i in only or [] if i not in claim_ids()]
    if unknown:
        raise UserError(f"--only {','.join(unknown)}: claims are {', '.join(claim_ids())}")
    workload = {k: v for k, v in (workload or {}).items() if v is not None}
    if (workload or target) and (only is None or any(i not in WORKLOAD_CLAIMS for i in only)):
        raise UserError(
            f"--model/--data/--target apply to the time-to-target claim: add --only {','.join(WORKLOAD_CLAIMS)}"
        )
    if workload and target is None:
        raise UserError(
            "--model/--data: give the target in the workload's metric, e.g. --target perplexity=12 or "
            "--target accuracy=0.9"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
    ctx = Ctx(out, quick, os.geteuid() == 0, workload, target)
    claims: list[dict[str, Any]] = []
    result = {"quick": quick, "root": ctx.root, "claims": claims}
    for c in CLAIMS:
        selected = only is None or c.id in only
        if selected:
            print(f"reproduce: {c.id}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        claims.append(assess(c, ctx, selected) | {"seconds": round(time.perf_counter() - t0, 1)})
        # After every claim, so an interrupted run keeps what it measured.
        (out / "claims.json").write_text(json.dumps(result, indent=2))
    write_page(result, out)
    return result


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["claim", "source", "verdict", "why", "run"]
    rows = [[c["claim"], c["source"], c["verdict"], c["why"], c["run"] or "-"] for c in result["claims"]]
    return header, rows


def write_page(result: dict[str, Any], out: Path) -> None:
    from parambox.report.page import html_page, markdown_table

    title = "parambox reproduce: the seeds' claims" + (
        " (quick form: checks only)" if result["quick"] else ""
    )
    header, rows = table_rows(result)
    figures = [(f"{c['id']}: {c['claim']}", out / c["plot"]) for c in result["claims"] if c["plot"]]
    tables = [t for t in (tau_table(result), simulator_table(result), tau_h_table(result)) if t is not None]
    md = [f"# {title}", "", markdown_table(header, rows), ""]
    md += [f"## {cap}\n\n{markdown_table(h, r)}\n" for cap, h, r in tables]
    md += [f"## {cap}\n\n![{cap}]({p.relative_to(out)})\n" for cap, p in figures]
    (out / "index.md").write_text("\n".join(md))
    (out / "index.html").write_text(html_page(title, header, rows, figures, base=out, tables=tables))


def simulator_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]] | None:
    """The simulator's validation: each setup's step time measured on the emulated cluster and simulated."""
    claim = next((c for c in result["claims"] if c["id"] == "simulator"), None)
    if claim is None or not claim["measured"]:
        return None
    caption = "The simulator against the emulated cluster (bench cluster; compute from its ceiling setup)"
    return (caption, *sim.validation_table(claim["measured"]))


def tau_h_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]] | None:
    claim = next((c for c in result["claims"] if c["id"] == "tau-h"), None)
    if claim is None or not claim["measured"]:
        return None
    m = claim["measured"]
    caption = (
        f"The tau-H table: {m['workers']} workers on {m['data']}, {m['steps']} steps; steps to the target "
        f"measured on loopback, seconds at each link rate simulated (compute {m['compute_ms']:.1f} ms a step)"
    )
    return (caption, *sim.tau_h_table(m))


def tau_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]] | None:
    """The EASGD paper's tau table: final test accuracy (%) per method and tau, if it was measured."""
    claim = next((c for c in result["claims"] if c["id"] == "easgd-tau"), None)
    if claim is None or not claim["measured"]:
        return None
    m = claim["measured"]
    header = ["method (lr)"] + [f"tau {t}" for t in m["taus"]]
    rows = [
        [f"{method} ({m['lr'][method]:g})"] + [f"{acc[str(t)]:.1f}" for t in m["taus"]]
        for method, acc in m["test_accuracy_pct"].items()
    ]
    caption = f"Test accuracy (%) after {m['steps']} steps, {m['workers']} workers, by tau"
    return caption, header, rows
