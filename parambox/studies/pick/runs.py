"""The runs ``parambox pick`` makes: plain ``parambox train`` subprocesses, as a user would type them,
on the launcher and emulated cluster of the base config, read back from their ``metrics.jsonl``.

A probe is stopped (Ctrl-C to its launcher) once rank 0 logs a test loss at its stop level, a run *to
the target* once rank 0 logs a test metric that reaches the target (at or above it; at or under for perplexity, a loss) (else they end with their steps). Its time to target
is the training time until the step before that evaluation: the run's own clock (start-up excluded)
less rank 0's evaluation pauses, the basis the predictions are on too (``reached_wall_s`` keeps them).
An asynchronous run's other ranks train on while rank 0 evaluates, so there it is the global samples
at that step over the ranks' training pace (``Measured.training_rate``), the same pace its probe's
prediction uses: rank 0's clock less its pauses would credit the run with the samples the others
made meanwhile (on loopback, 2 ms steps and an evaluation every 4: a quarter of rank 0's time).
``run_to_target`` is the one function validation depends on, so the time-to-accuracy study can take
its place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parambox.errors import terminate_as_interrupt
from parambox.runtime import spawn, zygote
from parambox.studies.pick.model import Curve, Prediction, StepCost, samples_to_target, step_cost
from parambox.studies.runs import _last_error, clock_lead, train_args
from parambox.workload.targets import Target

POLL_S = 0.1


@dataclass
class Measured:
    """What one run gave: its step records and evaluations, read from ``metrics.jsonl``."""

    run_dir: Path
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    error: str | None = None
    user_error: bool = False  # the run refused the user's input (exit 2), rather than failing
    reached_s: float | None = None  # training seconds to the target, evaluations left out
    reached_wall_s: float | None = None  # the same with the evaluations' pauses in
    lead_s: float = 0.0  # training other ranks did before rank 0's clock started (``clock_lead``)
    metric: str = "test_accuracy"  # the target's metric
    lower_is_better: bool = False  # its direction (``parambox.workload.targets``)
    # Asynchronous runs: every rank's (start epoch, [(time, cumulative local samples)]); the global
    # samples come from all of them on one clock, not from rank 0's pace times the ranks.
    ranks: dict[int, tuple[float, list[tuple[float, float]]]] | None = None

    @property
    def samples_per_step(self) -> float | None:
        last = self.steps[-1] if self.steps else None
        return last and last["samples_per_s"] * last["time"] / last["step"]

    def global_samples(self, rank0_time: float) -> float:
        """Samples every rank had consumed when rank 0's clock read ``rank0_time`` (aligned clocks)."""
        if not self.ranks or 0 not in self.ranks:
            return 0.0
        at = self.ranks[0][0] + rank0_time
        total = 0.0
        for epoch, points in self.ranks.values():
            done = [n for t, n in points if epoch + t <= at + 1e-9]
            total += done[-1] if done else 0.0
        return total

    def curve(self, metric: str) -> Curve:
        """``metric`` of every evaluation (step > 0) against global samples."""
        per_step = self.samples_per_step or 0.0
        step_time = {r["step"]: r["time"] for r in self.steps}
        pts = []
        for e in self.evals:
            if e.get(metric) is None:
                continue
            x = e["step"] * per_step
            if self.ranks and e["step"] in step_time:
                x = self.global_samples(step_time[e["step"]])
            pts.append((x, e[metric]))
        return Curve([p[0] for p in pts], [float(p[1]) for p in pts])

    @property
    def warmup(self) -> int:
        """The first steps left out of its timing (start-up: forks, first allocations)."""
        return max(2, len(self.steps) // 10)

    def cost(self, warmup: int | None = None) -> StepCost | None:
        warmup = self.warmup if warmup is None else warmup
        cost = step_cost(self.steps, {e["step"] for e in self.evals}, warmup)
        if cost is None or not self.ranks:
            return cost
        rate = self.training_rate(warmup)
        return StepCost(cost.step_s, cost.comm_s, rate * cost.step_s) if rate else cost

    def training_rate(self, warmup: int | None = None) -> float | None:
        """Asynchronous runs: global samples per second of training, every rank's own pace summed.
        Rank 0's over its steps less those that follow an evaluation (it paused for it), every other
        rank's over its steps past ``warmup``: the others do not evaluate and train on while rank 0
        does, so a rate over rank 0's clock, pauses in, would count samples a run without
        evaluations does not get. None for a run without every rank's records (a synchronous one)."""
        warmup = self.warmup if warmup is None else warmup
        if not self.ranks or 0 not in self.ranks:
            return None
        evaluated = {e["step"] for e in self.evals}
        steps = [r for r in self.steps if r["step"] > warmup]
        kept = [
            (b["time"] - a["time"], b["step"] - a["step"])
            for a, b in zip(steps, steps[1:])
            if a["step"] not in evaluated and b["step"] == a["step"] + 1
        ]
        points0 = self.ranks[0][1]
        if not kept or len(points0) < 2:
            return None
        per_step = points0[-1][1] / len(points0)  # rank 0's samples a step
        rate = per_step * sum(n for _, n in kept) / sum(t for t, _ in kept)
        for rank, (_, points) in self.ranks.items():
            window = points[min(warmup, len(points) - 2) :]
            if rank != 0 and len(window) >= 2 and window[-1][0] > window[0][0]:
                rate += (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        return rate if rate > 0 else None

    def goal(self, target: float) -> Target:
        """``target`` as a value of this run's metric, in its direction."""
        return Target(self.metric.removeprefix("test_"), target, self.lower_is_better)

    def samples_to(self, target: float) -> float | None:
        c = self.curve(self.metric)
        return samples_to_target(c.samples, c.values, self.goal(target))

    def time_to(self, target: float) -> tuple[float, float] | None:
        """(training seconds, seconds) to the first evaluation at ``target``: the first leaves out rank 0's
        evaluation pauses before it (each from the step record to the eval record after it), as the
        predictions do; both count from the first rank's start (``lead_s``); None when no evaluation
        got there."""
        goal = self.goal(target)
        hit = goal.first((e, e.get(self.metric)) for e in self.evals)
        if hit is None:
            return None
        step_time = {r["step"]: r["time"] for r in self.steps}
        at = step_time.get(hit["step"], hit["time"])
        wall = hit["time"] + self.lead_s
        rate = self.training_rate()
        if rate:  # asynchronous: the samples that reached it at the ranks' training pace
            return self.global_samples(at) / rate, wall
        pauses = sum(
            e["time"] - step_time[e["step"]]
            for e in self.evals
            if e["step"] < hit["step"] and e["step"] in step_time
        )
        return at - pauses + self.lead_s, wall

    def staleness(self) -> float | None:
        values = [r["staleness"] for r in self.steps if isinstance(r.get("staleness"), int | float)]
        return sum(values) / len(values) if values else None


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Rank 0's step and eval records so far (a half-written last line is skipped)."""
    steps, evals = [], []
    try:
        text = (run_dir / "metrics.jsonl").read_text(errors="replace")
    except FileNotFoundError:
        return steps, evals
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "step":
            steps.append(rec)
        elif rec.get("kind") == "eval" and rec.get("step", 0) > 0:
            evals.append(rec)
    return steps, evals


def read_ranks(run_dir: Path) -> dict[int, tuple[float, list[tuple[float, float]]]]:
    """Every rank's start epoch and its (time, cumulative local samples) per step record. A record's
    ``samples_per_s x time`` counts the rank's samples times the data-parallel ranks (as if all kept
    its pace): divided by the ranks that log steps, it is the rank's own."""
    out: dict[int, tuple[float, list[tuple[float, float]]]] = {}
    for path in run_dir.glob("metrics*.jsonl"):
        stem = path.name.removeprefix("metrics").removesuffix(".jsonl")
        rank = 0 if stem == "" else int(stem.removeprefix(".rank")) if stem.startswith(".rank") else None
        if rank is None:
            continue
        epoch, points = None, []
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "world" and epoch is None:
                epoch = rec.get("epoch")
            elif rec.get("kind") == "step" and rec.get("step", 0) > 0:
                points.append((float(rec["time"]), float(rec["samples_per_s"]) * float(rec["time"])))
        if isinstance(epoch, int | float) and points:
            out[rank] = (float(epoch), points)
    n = len(out)
    return {r: (e, [(t, s / n) for t, s in pts]) for r, (e, pts) in out.items()}


def run_probe(
    config: dict[str, Any], run_dir: Path, timeout_s: float, stop_loss: float, aligned: bool = False
) -> Measured:
    """Train ``config`` until rank 0's test loss falls to ``stop_loss`` (or its steps run out);
    ``aligned``: count every rank's samples on the aligned clocks (asynchronous strategies)."""
    out = _run(config, run_dir, timeout_s, lambda e: e.get("test_loss", math.inf) <= stop_loss)
    if aligned:
        out.ranks = read_ranks(run_dir)
    return out


def median_time(times: list[float | None]) -> float | None:
    """The median of runs' times to the target, a run that did not reach it counted as slowest (None
    where that is the median).

    >>> median_time([0.3, None, 0.2]), median_time([None, 0.3, None]), median_time([0.2, 0.6])
    (0.3, None, 0.4)
    """
    m = statistics.median([math.inf if t is None else t for t in times])
    return None if math.isinf(m) else m


def step_cap(base_steps: int, p: Prediction) -> int:
    """Room for the prediction's upper end twice over, at least the base run's steps, at most 10x those."""
    if p.high_s is None:
        return base_steps
    steps = math.ceil(2 * p.high_s * p.cost.samples_per_s / p.cost.samples_per_step)
    return int(min(max(steps, base_steps), 10 * base_steps))


def run_to_target(
    config: dict[str, Any], run_dir: Path, target: Target, timeout_s: float, aligned: bool = False
) -> Measured:
    """Train ``config`` until rank 0's test metric reaches ``target`` (or its steps run out)."""
    out = _run(config, run_dir, timeout_s, lambda e: target.reached(e.get(target.key)))
    out.metric, out.lower_is_better = target.key, target.lower_is_better
    if aligned:
        out.ranks = read_ranks(run_dir)
    reached = out.time_to(target.value)
    if reached is not None:
        out.reached_s, out.reached_wall_s = reached
    return out


def _run(config: dict[str, Any], run_dir: Path, timeout_s: float, done: Callable[[dict], bool]) -> Measured:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "parambox", *train_args(config, run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **zygote.shared_env())  # workers forked warm
    out = Measured(run_dir)
    with terminate_as_interrupt(), open(run_dir / "train.log", "w") as log:
        # A session of its own: stopping it stops the run's workers (and its cluster) too.
        proc = spawn.start(cmd, env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = _wait(proc, _EvalWatch(run_dir / "metrics.jsonl", done), time.monotonic() + timeout_s)
            if proc.poll() is None:
                interrupt(proc)
        finally:
            spawn.stop([proc])
    out.steps, out.evals = read_metrics(run_dir)
    out.lead_s = clock_lead(run_dir)
    if code == "timeout":
        out.error = f"ran past {timeout_s:.0f} s"
    elif code not in (0, "reached"):
        out.error = _last_error(run_dir / "train.log", code)
        out.user_error = code == 2
    elif not out.steps:
        out.error = "no step records"
    return out


def interrupt(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Ctrl-C to the launcher alone: it stops its workers, removes their shared memory and takes its
    emulated cluster down, as after a user's Ctrl-C (a SIGTERM to the whole group would leave that undone)."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass  # the caller's spawn.stop finishes the job


def _wait(proc, reached: _EvalWatch, deadline: float):
    while True:
        code = proc.poll()
        if code is not None:
            return code
        if reached():
            return "reached"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(POLL_S)


class _EvalWatch:
    """Has rank 0 logged an evaluation that is ``done`` yet? Reads only what was appended since the
    last look, and parses only eval lines: the workers share the cores with this loop."""

    def __init__(self, path: Path, done: Callable[[dict], bool]):
        self.path, self.done, self.offset, self.partial = path, done, 0, b""

    def __call__(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return False
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            if b'"eval"' in line:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("kind") == "eval" and rec.get("step", 0) > 0 and self.done(rec):
                    return True
        return False
