"""The benchmarks' timed rounds (``bench/rounds.py``): what a setup's meter counts."""

from __future__ import annotations

import threading
import time

import pytest

from parambox.bench.rounds import run_rounds, settled


class Link:
    """A byte counter that a background "exchange" keeps moving after the step that started it."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self.lock = threading.Lock()

    def read(self) -> float:
        with self.lock:
            return self.bytes

    def add(self, n: float) -> None:
        with self.lock:
            self.bytes += n

    def trickle(self, total: float, pieces: int, gap_s: float) -> None:
        def run() -> None:
            for _ in range(pieces):
                time.sleep(gap_s)
                self.add(total / pieces)

        threading.Thread(target=run, daemon=True).start()


def test_an_exchange_in_flight_at_the_end_of_a_setups_steps_counts_for_that_setup():
    """Before: the overlapped setup's last exchange, 100 kB landing over 0.3 s after its steps, was
    counted by the setup that ran next (bench cluster's ceiling showed link bytes it never sends)."""
    link = Link()

    def overlapped(batch, i):
        link.add(1000.0)  # the step's own bytes
        if i % 4 == 3:  # the last step of each round starts an exchange that runs behind
            link.trickle(100_000.0, pieces=6, gap_s=0.05)

    r = run_rounds(
        {"overlapped": overlapped, "ceiling": lambda b, i: None}, [0], 2, 4, 0, 1, lambda: None, link.read
    )
    assert r.metered["ceiling"] == [0.0, 0.0]
    assert r.metered["overlapped"] == pytest.approx([1000.0 + 100_000.0 / 4] * 2)


def test_settled_waits_for_a_quiet_meter_and_no_longer_than_its_limit():
    link = Link()
    assert settled(link.read) == 0.0
    link.trickle(9000.0, pieces=3, gap_s=0.05)
    assert settled(link.read) == pytest.approx(9000.0)
    busy = Link()
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            busy.add(10_000.0)
            time.sleep(0.01)

    threading.Thread(target=flood, daemon=True).start()
    t0 = time.monotonic()
    settled(busy.read, limit_s=0.5)
    stop.set()
    assert time.monotonic() - t0 < 1.0


def test_the_machines_cpu_counts_at_least_the_workers_own():
    """``cpu_machine``: the whole machine's busy CPU a step (every process and the kernel's; other work on
    a shared machine too): a step that spins 50 ms of this thread's CPU counts at least that much."""

    def spin(_batch: object, _i: int) -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    result = run_rounds({"spin": spin}, [None], 2, 4, 0, 1, lambda: None)
    assert len(result.cpu_machine["spin"]) == 2
    assert min(result.cpu_machine["spin"]) >= 0.045 and min(result.cpu["spin"]) >= 0.045
