"""The local launcher: ``parambox train --workers N`` on one machine, no cluster or MPI needed.

It spawns N worker processes on loopback (or hands them to ``mpiexec`` when the strategy needs MPI),
or on the nodes of an emulated cluster (``--emulate-nodes``: ``parambox.runtime.cluster``),
prefixes each worker's output with its rank, and owns clean-up: when a worker fails it stops the
others within seconds and names the rank and its error (or, with ``--max-restarts``, replaces it or
restarts the group: ``runtime/supervisor.py``); on SIGINT it stops them all; at the end it removes
every shared-memory segment the run created, also those of a crashed worker. Its workers learn
from it which peers are dead through the board of ``runtime/control.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from parambox.runtime import elastic, spawn
from parambox.runtime.cluster import WINDOWS_MCA, ClusterConfig
from parambox.runtime.control import (
    CONSOLE_ENV,
    HEARTBEAT_ENV,
    JOIN_FROM_ENV,
    LIFE_ENV,
    REJOIN_ENV,
    RUNNING,
    SPARE_FLAG,
    WorkerBoard,
    joins_from,
)
from parambox.runtime.supervisor import LaunchResult, Starters, Supervisor, worker_error

__all__ = ["LaunchResult", "launch_local", "threads_per_worker", "worker_error"]


def threads_per_worker(num_workers: int, threads: int | None) -> int:
    return threads or max(1, (os.cpu_count() or 1) // num_workers)


def launch_local(
    argv: list[str],
    num_workers: int,
    log_dir: Path,
    threads: int | None = None,
    use_mpi: bool = False,
    tolerate_loss: bool = False,
    *,
    module: str = "parambox",
    cluster: ClusterConfig | None = None,
    max_restarts: int = 0,
    warm_spare: bool = False,
    resume_argv: list[str] | None = None,
    checkpoint: Path | None = None,
    stall_timeout_s: float = 0.0,
    shrink: bool = False,
    mpi_windows: bool = False,
    lose_rank0: bool = False,
    start_workers: int | None = None,
) -> LaunchResult:
    """Run ``python -m <module> <argv>`` as ``num_workers`` ranks and supervise them.

    ``cluster``: on the nodes of an emulated cluster that lives exactly as long as they do.
    ``max_restarts``: replacements of dead workers (``tolerate_loss``; from a ``warm_spare`` process
    where there is one) or restarts of the whole group (synchronous), with ``resume_argv`` once
    ``checkpoint`` exists. Under MPI (one job, which takes no replacement rank) a failed job is
    started again whole. ``stall_timeout_s``: how long rank 0 may write
    nothing to ``metrics.jsonl`` (beside ``log_dir``) once it is the last rank running. ``shrink``: a
    synchronous run whose survivors go on in place (``runtime/elastic.py``) over a store hosted here.
    ``lose_rank0`` (with ``tolerate_loss``): rank 0 dead with no restart left is lost as any other
    rank (another worker takes its part), not the end of the run. ``start_workers``: the run starts
    with the ranks below it; the others join it once up (``shrink``: at a step boundary; asynchronous:
    they attach to the box as replacements do).
    ``mpi_windows``: the job puts MPI windows across the emulated nodes (``box.server=false``), which
    Open MPI's TCP progress thread must serve (``cluster.WINDOWS_MCA``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    prefix = spawn.new_prefix()
    n_threads = threads_per_worker(num_workers, threads)
    env = spawn.loopback_env(n_threads, prefix)
    env.update(PARAMBOX_LOG_DIR=str(log_dir), PARAMBOX_THREADS=str(n_threads))
    cmd = [sys.executable, "-m", module, *argv]
    # The ranks' temporary files in a directory of the run's, removed once they are stopped (by a
    # reaper if this process is SIGKILLed): a rank killed mid-run leaves what it and its data loaders
    # made there (multiprocessing's pymp-* folders).
    with contextlib.ExitStack() as stack:  # the cluster closes after the workers are stopped
        env["TMPDIR"] = stack.enter_context(spawn.segments_guarded(prefix, tmpdir=True))
        net = stack.enter_context(cluster.build(num_workers)) if cluster is not None else None
        watch = {"heartbeat": log_dir.parent / "metrics.jsonl", "stall_s": stall_timeout_s}
        watch["lose_rank0"] = lose_rank0 and tolerate_loss
        env[HEARTBEAT_ENV] = str(watch["heartbeat"])  # rank 0 touches it as it steps, the others theirs
        if start_workers is not None:
            env[JOIN_FROM_ENV] = str(start_workers)  # the ranks from it on join the run once it is under way
        resume_cmd = [sys.executable, "-m", module, *(resume_argv or argv)]
        if use_mpi:
            mca = WINDOWS_MCA if mpi_windows else None
            mpi_command = functools.partial(net.mpi_launch, mca=mca) if net is not None else None
            restart_job = (max_restarts, resume_cmd, checkpoint)
            return _launch_mpi(
                cmd, num_workers, env, log_dir, tolerate_loss, mpi_command, stall_timeout_s, restart_job
            )
        restart = (max_restarts, resume_cmd, checkpoint, warm_spare)
        placement = net.placement(num_workers) if net is not None else None
        if shrink:
            store, address = elastic.host_store()  # lives as long as this process holds it
            watch["shrink_store"] = store
            env.update(elastic.store_env(store, address))
            watch["formed_at"] = start_workers
        return _launch_processes(
            cmd, num_workers, env, log_dir, tolerate_loss, restart, prefix, placement, watch
        )


def _launch_mpi(
    cmd: list[str],
    n: int,
    env: dict[str, str],
    log_dir: Path,
    tolerate_loss: bool,
    mpi_command: spawn.MpiCommand | None = None,
    stall_s: float = 0.0,
    restart: tuple[int, list[str], Path | None] = (0, [], None),
) -> LaunchResult:
    """One mpiexec job (under ULFM where a dead rank must not end it); MPI tells the ranks of deaths.
    ``stall_s`` (--timeout): the job is stopped once none of its ranks showed progress for about twice
    that (a hung rank 0 of an asynchronous run would otherwise keep its memory rank serving forever).
    ``restart`` = (max_restarts, resume command, checkpoint): a job that fails anyway (a memory rank
    lost across nodes, whose shard of the box was its own memory; a rank no other can stand in for)
    is started again, every rank, from the last checkpoint: the steps since it are what is lost."""
    max_restarts, resume_cmd, checkpoint = restart
    popen = {"fault_tolerant": tolerate_loss, "mpi_command": mpi_command, "stderr": subprocess.PIPE}

    def job(life: int, resume: bool) -> list[subprocess.Popen]:
        proc = spawn.start_mpi(resume_cmd if resume else cmd, n, env, **popen)
        threading.Thread(target=_pump_mpi_stderr, args=(proc.stderr,), daemon=True).start()
        return [proc]

    def one(rank: int, life: int) -> subprocess.Popen:
        raise AssertionError("an MPI job takes no replacement rank: it restarts whole")

    starters = Starters(job, one, spawn.stop, lambda: checkpoint is not None and checkpoint.exists())
    procs = job(0, False)
    try:
        supervisor = Supervisor(
            procs,
            log_dir,
            tolerate_loss=False,
            stall_s=stall_s,
            job_dir=log_dir.parent,
            starters=starters if max_restarts else None,
            max_restarts=max_restarts,
        )
        return supervisor.run()
    finally:
        spawn.stop(procs)


def _launch_processes(
    cmd: list[str],
    n: int,
    env: dict[str, str],
    log_dir: Path,
    tolerate_loss: bool,
    restart: tuple[int, list[str], Path | None, bool],
    prefix: str,
    placement: spawn.Placement | None = None,
    watch: dict | None = None,
) -> LaunchResult:
    """``n`` worker processes, the board that tells them who is dead, and replacements or restarts."""
    max_restarts, resume_cmd, checkpoint, warm_spare = restart
    board = WorkerBoard.create(n)
    env = dict(env, **board.env())
    # Set once a rank failed: what the others print then (a closed store's C++ warnings, "connection
    # closed") are symptoms, and the one line naming the cause is what the user should see.
    muted = threading.Event()
    ranks = _Ranks(n, placement, muted, _Life(log_dir / "life0"))

    def group(life: int, resume: bool) -> list[subprocess.Popen]:
        ranks.life = _Life(log_dir / f"life{life}")
        spawn.remove_segments(prefix)  # the stopped group's boxes
        for err in log_dir.glob("rank*.err"):  # (a restart's supervisor moved its cause's to logs/life{k})
            err.unlink(missing_ok=True)  # a new life: old errors are no longer the run's
        for rank in range(n):
            board.set_state(rank, RUNNING)
        genv = spawn.loopback_env(base=env)  # a fresh rendezvous port
        genv[LIFE_ENV] = genv[elastic.GROUP_LIFE_ENV] = str(life)
        env[elastic.GROUP_LIFE_ENV] = str(life)  # a replacement joins this life's elastic group
        return ranks.start_all(resume_cmd if resume else cmd, genv, [board.fd])

    def one(rank: int, life: int) -> subprocess.Popen:
        renv = dict(env, **{LIFE_ENV: str(life), REJOIN_ENV: "1"})
        proc = ranks.take_spare(rank, renv) or ranks.start(cmd, rank, renv, [board.fd])
        if warm_spare:
            ranks.keep_spare(cmd, env, [board.fd])  # the next one warms up while this one works
        return proc

    starters = Starters(group, one, ranks.stop_life, lambda: checkpoint is not None and checkpoint.exists())
    procs = ranks.start_all(cmd, env, [board.fd])
    warm_spare = warm_spare and bool(max_restarts) and tolerate_loss and placement is None
    if warm_spare:
        ranks.keep_spare(cmd, env, [board.fd])
    try:
        supervisor = Supervisor(
            procs,
            log_dir,
            tolerate_loss,
            board=board,
            starters=starters,
            max_restarts=max_restarts,
            muted=muted,
            **(watch or {}),
        )
        return supervisor.run()
    finally:
        spawn.stop(procs)
        ranks.drop_spare()
        board.close()


@dataclass
class _Ranks:
    """Starts the run's ranks: where (``placement``: on an emulated node) and how their output shows.

    A *spare* (asynchronous runs with ``--max-restarts``, not on an emulated cluster) is a worker
    process started ahead of need (``python -m parambox.run.worker RUN_DIR --spare``): it has imported
    torch and parambox and loaded the run's data, and waits on its stdin to be told which dead rank it
    replaces (its whole environment, as a JSON line). A replacement then costs no interpreter start-up,
    which is most of what a cold one costs (torch's import alone takes ~1.5 s here)."""

    n: int
    placement: spawn.Placement | None
    muted: threading.Event
    life: _Life  # the group's life whose ranks are starting
    spare: tuple[subprocess.Popen, list[str]] | None = None  # the process, and its output's label

    def start_all(self, cmd: list[str], env: dict[str, str], fds: list[int]) -> list[subprocess.Popen]:
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(self.n):
                procs.append(self.start(cmd, rank, env, fds))
        except BaseException:
            spawn.stop(procs)
            raise
        return procs

    def start(self, cmd: list[str], rank: int, env: dict[str, str], fds: list[int]) -> subprocess.Popen:
        # Rank 0 owns the terminal (progress bar, summary); the others are prefixed with their rank.
        if rank >= joins_from(self.n, env):  # it joins the run under way, as a replacement does
            env = dict(env, **{REJOIN_ENV: "1"})
        renv = spawn.rank_env(env, rank, self.n, local_launcher=True)
        if self.placement is not None:
            cmd, renv = self.placement(rank, list(cmd), renv)
        if rank == 0:
            return self._rank0(cmd, renv, fds)
        return self._piped(cmd, renv, fds, [str(rank)])

    def _rank0(self, cmd: list[str], env: dict[str, str], fds: list[int]) -> subprocess.Popen:
        """Rank 0 writes to the console itself (its bar, its summary) but for the descriptor 2 of its C++
        code, which is pumped here unprefixed: what a stopped life prints goes to that life's log."""
        try:
            console = os.dup(sys.stderr.fileno())
        except (AttributeError, OSError, ValueError):  # no descriptor (a captured stderr): as it is
            return spawn.start(cmd, env, pass_fds=fds)
        try:
            env = dict(env, **{CONSOLE_ENV: str(console)})
            p = spawn.start(cmd, env, stderr=subprocess.PIPE, pass_fds=[*fds, console])
        finally:
            os.close(console)
        args = (p.stderr, sys.stderr, None, self.muted, self.life)
        threading.Thread(target=_pump, args=args, daemon=True).start()
        return p

    def _piped(
        self, cmd: list[str], env: dict[str, str], fds: list[int], label: list[str], **popen
    ) -> subprocess.Popen:
        p = spawn.start(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=fds, **popen)
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            args = (stream, sink, label, self.muted, self.life)
            threading.Thread(target=_pump, args=args, daemon=True).start()
        return p

    def stop_life(self, procs: list[subprocess.Popen]) -> None:
        """Stop the group for a restart: what its dying ranks print from now on (a closed peer's C++
        frames) goes to that life's log, not to the console of the run that goes on."""
        self.life.ended.set()
        spawn.stop(procs)

    def keep_spare(self, cmd: list[str], env: dict[str, str], fds: list[int]) -> None:
        if self.spare is None or self.spare[0].poll() is not None:
            label = ["spare"]
            self.spare = (self._piped([*cmd, SPARE_FLAG], env, fds, label, stdin=subprocess.PIPE), label)

    def take_spare(self, rank: int, env: dict[str, str]) -> subprocess.Popen | None:
        """The spare, told to be ``rank`` with ``env``; None when there is none alive."""
        if self.spare is None or self.spare[0].poll() is not None:
            return None
        (proc, label), self.spare = self.spare, None
        try:
            proc.stdin.write(
                (json.dumps(spawn.rank_env(env, rank, self.n, local_launcher=True)) + "\n").encode()
            )
            proc.stdin.close()
        except OSError:  # it died just now
            spawn.stop([proc])
            return None
        label[0] = str(rank)
        return proc

    def drop_spare(self) -> None:
        if self.spare is not None:
            spawn.stop([self.spare[0]])
            self.spare = None


# Under --with-ft ulfm every rank's Open MPI warns that its shared-memory one-sided component is
# "not tested for post-failure operation" (a banner of ~10 lines): known, and said in the README.
_ULFM_BANNER = (b"not tested for post-failure", b"help-mpi-ft.txt")


def _pump_mpi_stderr(stream) -> None:
    """mpiexec's stderr to ours, without ULFM's banners (Open MPI frames a help message in dashes)."""
    block: list[bytes] = []
    for raw in iter(stream.readline, b""):
        if raw.startswith(b"-----") and block:  # the closing line of a framed message
            _emit([*block, raw])
            block = []
        elif raw.startswith(b"-----") or block:
            block.append(raw)
        else:
            _emit([raw])
    _emit(block)


def _emit(lines: list[bytes]) -> None:
    text = b"".join(lines).replace(b"\0", b"")  # PRRTE ends its output with NUL bytes
    if text and not any(m in text for m in _ULFM_BANNER):
        out = getattr(sys.stderr, "buffer", None)  # (a StringIO where a test or notebook captures it)
        if out is None:
            sys.stderr.write(text.decode(errors="replace"))
        else:
            out.write(text)
        sys.stderr.flush()


# torch.distributed's complaints that a peer or the store went away (``[W... TCPStore.cpp] ...
# recvValue failed``) reach a rank's stderr before its launcher has seen that peer exit: they wait
# this long for the supervisor to mute the run's symptoms, and print only if it did not.
_SYMPTOMS = (b"TCPStore", b"c10d", b"ProcessGroupGloo", b"gloo/transport")
SYMPTOM_HOLD_S = 2.0


@dataclass
class _Life:
    """One life of a group of ranks; ``ended`` once it is stopped for a restart, its output then
    appended to ``log_dir/console.txt``."""

    log_dir: Path
    ended: threading.Event = field(default_factory=threading.Event)

    def keep(self, line: str) -> None:
        with contextlib.suppress(OSError):
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / "console.txt", "a") as f:
                f.write(line)


def _pump(stream, sink, label: list[str] | None, muted: threading.Event, life: _Life) -> None:
    """A rank's output onto the console (prefixed with its rank; rank 0's: as it is), or into its life's
    log once that life is stopped."""
    prefix = f"[rank {label[0]}] " if label else ""
    for raw in iter(stream.readline, b""):
        if not muted.is_set() and any(m in raw for m in _SYMPTOMS):
            deadline = time.monotonic() + SYMPTOM_HOLD_S
            while not (muted.is_set() or life.ended.is_set()) and time.monotonic() < deadline:
                life.ended.wait(0.05)
        if life.ended.is_set():
            life.keep(f"[rank {label[0] if label else 0}] {raw.decode(errors='replace')}")
            continue
        if muted.is_set():
            continue  # keep draining, so the rank never blocks on a full pipe
        sink.write(f"{prefix}{raw.decode(errors='replace')}")
        sink.flush()
