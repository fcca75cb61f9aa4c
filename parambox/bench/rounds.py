"""The one timed-rounds harness of the side-by-side benchmarks, and the statistics they report.

Every setup runs in the same processes. Each setup first takes ``warmup`` untimed steps; then, in each
of ``rounds`` rounds, every setup runs ``steps`` timed steps between two barriers, one setup after the
other, the order rotating each round. Reporting medians of the per-round *paired* ratios (setup A's
round r against setup B's round r) cancels most of the drift of a shared machine: a burst of foreign
load hits both members of a pair alike.

>>> paired_ratio([100.0, 200.0, 100.0], [110.0, 180.0, 100.0])  # medians of 100/110, 200/180, 1
1.0
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

Stepper = Callable[[Any, int], Any]  # (batch, step index) -> anything (a loss, a StepResult, None)


@dataclass
class Rounds:
    """What ``run_rounds`` measured, per setup: samples/s per round, what each step returned (warm-up
    steps first), the increase of the ``meter`` per timed step, per round, and this process's CPU
    seconds per timed step, per round: all its threads' (``cpu``) and the calling thread's
    (``cpu_main``; the rest is the communication threads': gloo's, a box's server), and the whole
    machine's (``cpu_machine``: every process and the kernel's interrupt work, the network's included;
    the same in every process on one machine)."""

    per_round: dict[str, list[float]]
    outputs: dict[str, list[Any]]
    metered: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    cpu_main: dict[str, list[float]] = field(default_factory=dict)
    cpu_machine: dict[str, list[float]] = field(default_factory=dict)


def _machine_cpu_s() -> float:
    """CPU seconds the machine has spent busy so far (psutil's system-wide times, idle and iowait left out)."""
    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def run_rounds(
    steppers: dict[str, Stepper],
    batches: Sequence[Any],
    rounds: int,
    steps: int,
    warmup: int,
    samples_per_step: int,
    barrier: Callable[[], object],
    meter: Callable[[], float] | None = None,
) -> Rounds:
    """Run the rounds. ``samples_per_step`` counts every process's samples of one step (the throughput
    is global); ``barrier`` releases the processes together before and after each setup's timed steps;
    ``meter`` is a cumulative count read around them (e.g. the bytes over this process's link)."""
    names = list(steppers)
    result = Rounds({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names} if meter else {})
    result.cpu, result.cpu_main = {n: [] for n in names}, {n: [] for n in names}
    result.cpu_machine = {n: [] for n in names}
    for name, step in steppers.items():
        result.outputs[name] += [step(batches[i % len(batches)], i) for i in range(warmup)]
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = steppers[name]
            barrier()
            count0 = meter() if meter else 0.0
            machine0 = _machine_cpu_s()
            cpu0, main0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
            for i in range(steps):
                result.outputs[name].append(step(batches[i % len(batches)], warmup + r * steps + i))
            cpu1, main1, machine1 = time.process_time(), time.thread_time(), _machine_cpu_s()
            barrier()
            result.per_round[name].append(samples_per_step * steps / (time.perf_counter() - t0))
            result.cpu[name].append((cpu1 - cpu0) / steps)
            result.cpu_main[name].append((main1 - main0) / steps)
            result.cpu_machine[name].append((machine1 - machine0) / steps)
            if meter:
                result.metered[name].append((settled(meter) - count0) / steps)
    return result


QUIET_BYTES = 2048  # a link that moved less than this over settled's quiet_s carries no exchange


def settled(meter: Callable[[], float], quiet_s: float = 0.1, limit_s: float = 10.0) -> float:
    """``meter`` once it has moved by less than ``QUIET_BYTES`` over ``quiet_s``, or after ``limit_s``:
    an exchange still in flight when a setup's timed steps end (an overlapped or asynchronous one, or a
    peer's into this process's part of the box) lands in that setup's count, not the next one's."""
    last, deadline = meter(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = meter()
        if now - last < QUIET_BYTES:
            return now
        last = now
    return last


def timed_rounds(
    steppers: dict[str, Stepper],
    batches: Sequence[Any],
    rounds: int,
    steps: int,
    warmup: int,
    samples_per_step: int,
    barrier: Callable[[], object],
) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """``run_rounds`` without a meter: (samples/s per setup and round, what each step returned)."""
    r = run_rounds(steppers, batches, rounds, steps, warmup, samples_per_step, barrier)
    return r.per_round, r.outputs


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median of the per-round ratios ``numerator[r] / denominator[r]``."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))
