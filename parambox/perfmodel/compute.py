"""T_comp(b): the time of one training step (forward, backward, optimizer step) at local batch size b.

Measured here over a set of batch sizes and interpolated piecewise-linearly in log-log space, so the
per-sample cost rising at small batches (skinny GEMMs, fixed per-layer overheads: Keuper & Pfreundt's
second limit) is kept, not averaged away. Above the largest measured batch the time is extrapolated
linearly (per-sample cost of the largest batch), where GEMM efficiency has saturated.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from parambox.errors import UserError
from parambox.numerics import is_finite
from parambox.perfmodel.sample import Sample
from parambox.runtime.heap import keep_freed_memory


@dataclass(frozen=True)
class ComputeProfile:
    """Step time (seconds) at measured or given batch sizes; ``time_s(b)`` interpolates.

    >>> p = ComputeProfile({1: 0.002, 4: 0.004})
    >>> round(p.time_s(2) * 1e3, 4), round(p.time_s(8) * 1e3, 4)  # log-log between, linear above
    (2.8284, 8.0)
    """

    seconds_by_batch: Mapping[int, float]
    source: str = "given"
    threads: int | None = None
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.seconds_by_batch:
            raise UserError("compute profile needs at least one batch size")
        for b, t in self.seconds_by_batch.items():
            if b < 1 or not t > 0 or not is_finite(t):
                raise UserError(f"compute time for batch {b} must be a positive number of ms, got {t * 1e3}")

    @classmethod
    def per_sample(cls, ms_per_sample: float) -> ComputeProfile:
        """A purely linear cost (no small-batch penalty): ``--comp-ms`` per sample."""
        if not ms_per_sample > 0:
            raise UserError(f"--comp-ms must be > 0, got {ms_per_sample}")
        return cls({1: ms_per_sample * 1e-3}, source="given per sample")

    def time_s(self, batch: float) -> float:
        assert batch > 0
        sizes = sorted(self.seconds_by_batch)
        times = [self.seconds_by_batch[b] for b in sizes]
        if batch >= sizes[-1]:
            return times[-1] * batch / sizes[-1]
        if batch <= sizes[0]:
            # Below the smallest point: continue the first segment's log-log slope, clamped to [0, 1]
            # (a smaller batch never costs more, nor less than proportionally).
            slope = 1.0
            if len(sizes) > 1:
                slope = math.log(times[1] / times[0]) / math.log(sizes[1] / sizes[0])
            return times[0] * (batch / sizes[0]) ** min(max(slope, 0.0), 1.0)
        i = bisect.bisect_right(sizes, batch)
        b0, b1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        w = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return math.exp((1 - w) * math.log(t0) + w * math.log(t1))

    def as_json(self) -> dict:
        return {
            "source": self.source,
            "threads": self.threads,
            "ms_by_batch": {str(b): self.seconds_by_batch[b] * 1e3 for b in sorted(self.seconds_by_batch)},
            **self.notes,
        }


def parse_comp_table(text: str) -> ComputeProfile:
    """``"1:2.5,16:9,64:30"`` (batch size: milliseconds per step) -> a given profile."""
    table: dict[int, float] = {}
    for item in text.split(","):
        try:
            b, ms = item.split(":")
            table[int(b)] = float(ms) * 1e-3
        except ValueError:
            raise UserError(f"--comp-table item {item!r}: expected BATCH:MS, e.g. 1:2.5,64:30") from None
    return ComputeProfile(table, source="given table")


def batch_sizes_to_measure(needed: list[float], max_batch: int) -> list[int]:
    """Powers of two from 1 up to the largest needed batch (capped at ``max_batch``), plus any needed
    whole batch sizes under the cap, so the interpolation brackets every local batch the model asks for."""
    top = min(max(needed), max_batch)
    sizes = {2**k for k in range(int(math.log2(max(top, 1))) + 1)}
    sizes |= {int(b) for b in needed if b >= 1 and b <= max_batch and float(b).is_integer()}
    if top > max(sizes):
        sizes.add(int(top))
    return sorted(sizes)


def step_timer(
    model: nn.Module, opt: torch.optim.Optimizer, sample: Sample, batch: int
) -> Callable[[], None]:
    """A closure that runs one SGD training step on a random batch of ``sample``'s kind and the given size."""
    data = sample.batch(batch)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        sample.loss(model, data).backward()
        opt.step()

    return step


def best_times_s(
    steps: Mapping[int, Callable[[], None]], passes: int, min_pass_s: float = 0.02
) -> dict[int, float]:
    """Fastest wall time of each step function. Round-robin over the batch sizes, ``passes`` times (a
    burst of foreign load then hits one pass, not every repeat of one batch size), each pass repeating a
    step until ``min_pass_s`` has gone by (timer resolution for tiny steps). The minimum, not the median:
    on a shared machine other processes only ever add time (``--validate`` measures real steps alike)."""
    for fn in steps.values():
        fn()  # warm-up: allocator, first-touch of activations and momentum buffers
    best = dict.fromkeys(steps, math.inf)
    for _ in range(passes):
        for b, fn in steps.items():
            start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                best[b] = min(best[b], t1 - t0)
                if t1 - start >= min_pass_s:
                    break
    return best


def measure_profile(
    build: Callable[[], nn.Module],
    sample: Sample,
    batch_sizes: list[int],
    threads: int = 1,
    repeats: int = 3,
) -> ComputeProfile:
    """Measure T_comp at each batch size in this process with ``threads`` torch threads (restored afterwards).
    ``parambox predict`` measures in a fresh process instead (``measure.measure_compute``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    keep_freed_memory()  # as a training rank runs
    try:
        table = time_batches(build(), sample, batch_sizes, repeats)
    finally:
        torch.set_num_threads(before)
    return profile_from_times(table, threads)


def time_batches(model: nn.Module, sample: Sample, batch_sizes: list[int], repeats: int) -> dict[int, float]:
    """Seconds per SGD step (momentum 0.9) of ``model`` at each batch size, one model and optimizer for all."""
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    steps = {b: step_timer(model, opt, sample, b) for b in batch_sizes}
    return best_times_s(steps, repeats)


def profile_from_times(table: Mapping[int, float], threads: int) -> ComputeProfile:
    raw = {str(b): t * 1e3 for b, t in sorted(table.items())}
    return ComputeProfile(
        clamp_noise(table), source="measured", threads=threads, notes={"raw_ms_by_batch": raw}
    )


def clamp_noise(table: Mapping[int, float]) -> dict[int, float]:
    """Remove what timing noise (other processes on a shared machine) adds, by two physical bounds that
    only ever lower a time: a larger batch is never less efficient per sample (so t(b') <= t(b) * b'/b
    for b' > b: no superlinear speedup from noise in one large-batch point, which the linear extrapolation
    above the largest batch would amplify), and a smaller batch never takes longer (it could be padded)."""
    sizes = sorted(table)
    out = {sizes[0]: table[sizes[0]]}
    for prev, b in zip(sizes, sizes[1:]):
        out[b] = min(table[b], out[prev] * b / prev)
    best = math.inf
    for b in reversed(sizes):
        best = min(best, out[b])
        out[b] = best
    return out


def time_calls(fn: Callable[[], object], count: int, warmup: int = 0) -> list[float]:
    """Seconds of each of ``count`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
