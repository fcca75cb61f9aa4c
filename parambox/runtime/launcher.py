"""The local launcher: ``parambox train --workers N`` on one machine, no cluster or MPI needed.

It spawns N worker processes on loopback (or hands them to ``mpiexec`` when the strategy needs MPI),
or on the nodes of an emulated cluster (``--emulate-nodes``: ``parambox.runtime.cluster``),
prefixes each worker's output with its rank, and owns clean-up: when a worker fails it stops the
others within seconds and names the rank and its error; on SIGINT it stops them all; at the end it
removes every shared-memory segment the run created, also those of a crashed worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from parambox.runtime import spawn
from parambox.runtime.cluster import ClusterConfig

# Asynchronous runs: rank 0 exits only once every other worker is done or found lost, so a worker
# still running this long after rank 0 succeeded is hung; it is stopped and counted as lost.
STRAGGLER_GRACE_S = 30.0


@dataclass
class LaunchResult:
    returncode: int
    failed: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (exit code, one-line error)
    lost: list[int] = field(default_factory=list)  # ranks that died while the run carried on


def threads_per_worker(num_workers: int, threads: int | None) -> int:
    return threads or max(1, (os.cpu_count() or 1) // num_workers)


def launch_local(
    argv: list[str],
    num_workers: int,
    log_dir: Path,
    threads: int | None = None,
    use_mpi: bool = False,
    tolerate_loss: bool = False,
    module: str = "parambox",
    cluster: ClusterConfig | None = None,
) -> LaunchResult:
    """Run ``python -m <module> <argv>`` as ``num_workers`` ranks and supervise them; with ``cluster``,
    on the nodes of an emulated cluster that lives exactly as long as they do."""
    log_dir.mkdir(parents=True, exist_ok=True)
    prefix = spawn.new_prefix()
    n_threads = threads_per_worker(num_workers, threads)
    env = spawn.loopback_env(n_threads, prefix)
    env.update(PARAMBOX_LOG_DIR=str(log_dir), PARAMBOX_THREADS=str(n_threads))
    cmd = [sys.executable, "-m", module, *argv]
    # Set once a rank failed: what the others print then (a closed store's C++ warnings, "connection
    # closed") are symptoms, and the one line naming the cause is what the user should see.
    muted = threading.Event()
    with contextlib.ExitStack() as stack:  # the cluster closes after the workers are stopped
        net = stack.enter_context(cluster.build(num_workers)) if cluster is not None else None
        if use_mpi:
            procs = [spawn.start_mpi(cmd, num_workers, env, mpi_command=net and net.mpi_launch)]
        else:
            procs = _spawn(cmd, num_workers, env, muted, net and net.placement(num_workers))
        try:
            return _supervise(procs, log_dir, tolerate_loss, muted)
        finally:
            spawn.stop(procs)
            spawn.remove_segments(prefix)


def _spawn(
    cmd: list[str], n: int, env: dict[str, str], muted: threading.Event, placement=None
) -> list[subprocess.Popen]:
    # Rank 0 owns the terminal (progress bar, summary); the others are prefixed with their rank.
    pipes = [None] + [subprocess.PIPE] * (n - 1)
    procs = spawn.start_ranks(
        cmd, n, env, local_launcher=True, stdout=pipes, stderr=pipes, placement=placement
    )
    for rank, p in enumerate(procs[1:], 1):
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            threading.Thread(target=_pump, args=(stream, sink, rank, muted), daemon=True).start()
    return procs


def _pump(stream, sink, rank: int, muted: threading.Event) -> None:
    for raw in iter(stream.readline, b""):
        if muted.is_set():
            continue  # keep draining, so the rank never blocks on a full pipe
        sink.write(f"[rank {rank}] {raw.decode(errors='replace')}")
        sink.flush()


def _supervise(
    procs: list[subprocess.Popen], log_dir: Path, tolerate_loss: bool, muted: threading.Event | None = None
) -> LaunchResult:
    muted = muted or threading.Event()
    result = LaunchResult(0)
    interrupted = []
    rank0_done_at = None
    old = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    try:
        while True:
            codes = [p.poll() for p in procs]
            if tolerate_loss and len(procs) > 1 and codes[0] == 0:
                rank0_done_at = rank0_done_at or time.monotonic()
                if time.monotonic() - rank0_done_at > STRAGGLER_GRACE_S:
                    result.lost += [r for r, c in enumerate(codes) if c is None and r not in result.lost]
                    return result
            if interrupted:
                result.returncode = 130
                return result
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in result.failed and rank not in result.lost:
                    if tolerate_loss and rank != 0:
                        result.lost.append(rank)
                    else:
                        muted.set()
                        rank = _root_cause(procs, log_dir, rank)
                        result.failed[rank] = (
                            procs[rank].returncode,
                            worker_error(log_dir, rank, procs[rank].returncode),
                        )
                        result.returncode = 1
                        return result
            if all(c is not None for c in codes):
                return result
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, old)


# Errors a rank reports when a *peer* failed: they are symptoms, not the cause.
_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "timed out", "ranks not arrived")


def _root_cause(procs: list[subprocess.Popen], log_dir: Path, first: int) -> int:
    """The rank that failed first in cause, not in time: when one worker dies, its peers fail a
    moment later with "connection closed" and may be seen first. Wait briefly for the others, then
    prefer a rank killed by a signal, then one whose error is not such a symptom."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    for r in failed:
        if procs[r].returncode < 0:
            return r
    for r in failed:
        if not any(s in worker_error(log_dir, r, procs[r].returncode) for s in _SYMPTOMS):
            return r
    return first


def worker_error(log_dir: Path, rank: int, code: int) -> str:
    err = log_dir / f"rank{rank}.err"
    if err.exists() and err.read_text().strip():
        return err.read_text().strip().splitlines()[0]
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
