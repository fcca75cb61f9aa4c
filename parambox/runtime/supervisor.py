"""The local launcher's watch over its workers: failures, lost workers, replacements and restarts.

Every 50 ms it polls the workers. What it does when one exits non-zero depends on the strategy:

- asynchronous (``tolerate_loss``): the others carry on. With restarts left (``--max-restarts``) the
  rank is started again at once (a *replacement*: it attaches to the box, pulls the center and
  does its remaining steps); otherwise it is marked dead on the :class:`WorkerBoard`, so the others
  stop waiting for it, and listed as lost. Rank 0 (the one that collects the result) dead with no
  restart left fails the run, except where the strategy's center lives in the box
  (``lose_rank0``): it is lost then, and another worker takes its part at the end (the result). So
  does rank 0 writing no progress for ``--timeout`` once the others have ended (with restarts left,
  or ``lose_rank0``, it is killed and replaced or lost). Dogwild's master, rank 0, is lost or
  replaced as any rank: a survivor takes over as the master, and a replacement meets it.
- synchronous, surviving in place (``shrink_store``: ``on_failure = "shrink"``, ``runtime/elastic.py``):
  once every rank had joined the group, a dead rank (rank 0 too: the oldest survivor then leads and
  writes the result) is marked dead on the board and listed as lost, and the others regroup without it (with restarts left, a replacement is started instead:
  it joins at a step boundary and receives its state from a live rank); a rank the survivors fenced
  out (it stalled past their timeout) is SIGKILLed, and so is a rank the kernel shows stopped
  (SIGSTOP, a suspended job) for ``--timeout``: its death then ends the survivors' wait at once,
  where a stopped rank left alive costs them the decider's grace on top of their timeout. A death
  before the group formed, or one that leaves no live member to admit a replacement (every other
  rank is a replacement still waiting for its admission), falls back to the next case.
  An asynchronous run's rank stopped for ``--timeout`` is SIGKILLed too (and replaced, or lost): it
  may hold a lock of the box that its peers wait for.
- synchronous: every worker is stopped. With restarts left the whole group starts again from the
  last checkpoint (torchrun's behaviour: nothing before the checkpoint is lost); otherwise the run
  fails, naming the rank that caused it.
- an MPI job (one process, mpiexec, for all its ranks; MPI tells the ranks of deaths, and the job
  goes on where they survive): a job that fails anyway is the previous case's group, restarted whole
  from the last checkpoint with restarts left.

A worker's exit code 2 is a user error (bad input): restarting cannot help, so it ends the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parambox.errors import TERMINATING, warn
from parambox.runtime.control import DEAD, EXITED, WorkerBoard
from parambox.runtime.spawn import is_stopped

# Asynchronous runs: rank 0 exits only once every other worker is done or found lost, so a worker
# still running this long after rank 0 succeeded is hung; it is stopped and counted as lost.
STRAGGLER_GRACE_S = 30.0
# An MPI job is stopped when none of its ranks shows progress for JOB_STALL_FACTOR * --timeout + the
# margin: past the ranks' own timeouts (which name the missing peer), so it catches only what they
# cannot, such as a memory rank serving a hung rank 0.
JOB_STALL_FACTOR, JOB_STALL_MARGIN_S = 2.0, 5.0
POLL_S = 0.05
STOPPED_EVERY_S = 0.25  # how often the launcher looks for stopped workers (in place, asynchronous)
USER_ERROR = 2


@dataclass
class LaunchResult:
    returncode: int
    failed: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (exit code, one-line error)
    lost: list[int] = field(default_factory=list)  # ranks that died while the run carried on
    restarts: int = 0  # replacements (asynchronous) or group restarts (synchronous)
    earlier_lives_s: float = 0.0  # the whole group's lives before its last restart, start to failure
    mpi_job: bool = False  # one mpiexec job for every rank: ``failed``'s one entry is the job's

    def who(self, rank: int) -> str:
        """The failed process in words: a worker rank, or the MPI job (its ranks' errors say which)."""
        return "the MPI job" if self.mpi_job else f"worker rank {rank}"


@dataclass
class Starters:
    """How the supervisor starts processes: every rank (``group(life, resume)``) or one (``rank(r, life)``)."""

    group: Callable[[int, bool], list[subprocess.Popen]]
    rank: Callable[[int, int], subprocess.Popen]
    stop: Callable[[list[subprocess.Popen]], None]
    can_resume: Callable[[], bool] = lambda: False  # a checkpoint exists to restart the group from


class Supervisor:
    """Watches the workers of one local run (see the module docstring)."""

    def __init__(
        self,
        procs: list[subprocess.Popen],
        log_dir: Path,
        tolerate_loss: bool,
        *,
        board: WorkerBoard | None = None,
        starters: Starters | None = None,
        max_restarts: int = 0,
        muted: threading.Event | None = None,
        heartbeat: Path | None = None,
        stall_s: float = 0.0,
        shrink_store: Any = None,
        job_dir: Path | None = None,
        lose_rank0: bool = False,
        formed_at: int | None = None,
    ):
        self.procs, self.log_dir, self.tolerate_loss = procs, log_dir, tolerate_loss
        self.board, self.starters = board, starters
        self.muted = muted  # set on failure: the other ranks' output is symptoms from then on
        self.max_restarts = max_restarts if starters is not None else 0
        self.result = LaunchResult(0, mpi_job=job_dir is not None)
        self.finished: set[int] = set()
        self._interrupted: list[int] = []
        self._rank0_done_at: float | None = None
        # Rank 0 alone, the others gone: its metrics file must keep growing (a hung rank 0 would
        # otherwise hold the run forever, since no peer is left to time out on it).
        self.heartbeat, self.stall_s = heartbeat, stall_s
        self.shrink_store = shrink_store  # the elastic group's store (a run that survives in place)
        self.lose_rank0 = lose_rank0  # asynchronous: rank 0 may be lost (another worker takes its part)
        self.formed_at = formed_at  # in place: the ranks that form the group (the others join later)
        self.job_dir = job_dir  # an MPI job's run directory: its ranks' metrics files are its heartbeat
        self._job_beat: tuple[Any, float] = ((), time.monotonic())
        self._job_polled = self._job_moved = False  # looked at its files yet; seen them change since
        self._fenced: set[int] = set()
        self._joining: dict[int, int] = {}  # in place: rank -> the life of its replacement (ElasticGroup)
        self._group_life = 0  # restarts of the whole group (each runs the elastic protocol afresh)
        self._beat: tuple[tuple[int, int], float] = ((0, 0), time.monotonic())  # (size, mtime), when changed
        self._stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped
        self._stopped_at = 0.0
        self._life_started = time.monotonic()  # the whole group's current life

    def run(self) -> LaunchResult:
        """Poll until the run is over. Ctrl-C, SIGTERM (``kill``, a batch system's time limit) or SIGHUP
        (the terminal closed) ends it as an interrupt: the caller stops the workers, which checkpoint
        at their next step. Signal handlers exist only in the main thread: a launch from another
        thread (``parambox.train`` in a worker thread of the caller's) leaves signals to the caller."""
        interrupt = (signal.SIGINT, *TERMINATING)
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {sig: signal.signal(sig, lambda *_: self._interrupted.append(1)) for sig in interrupt}
        try:
            while not self._poll():
                time.sleep(POLL_S)
            return self.result
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    # -- one look at the workers ------------------------------------------------------------------------
    def _poll(self) -> bool:
        """True when the run is over (``self.result`` says how)."""
        if self._interrupted:
            self.result.returncode = 130
            return True
        codes = [p.poll() for p in self.procs]
        goes_on = self.tolerate_loss or self.shrink_store is not None
        if goes_on and len(self.procs) > 1 and codes[0] == 0 and self._stragglers(codes):
            return True
        self._kill_fenced(codes)
        self._kill_stopped(codes)
        if codes[0] is None and len(self.procs) > 1 and self._rank0_stalled(codes):
            return True
        if codes[0] is None and self.job_dir is not None and self._job_stalled():
            return True
        for rank, code in enumerate(codes):
            if code is None or rank in self.finished:
                continue
            if code == 0:
                self._finished(rank, EXITED)
            elif (self.tolerate_loss and self._replace_or_lose(rank, code)) or self._shrink(rank, code):
                continue
            elif self._group_restarts_for(rank) and self._restart_group(rank, code):
                return False
            else:
                self._fail(rank)
                return True
        return all(c is not None for c in codes) and len(self.finished) == len(self.procs)

    def _finished(self, rank: int, state: int) -> None:
        self.finished.add(rank)
        if self.board is not None:
            self.board.set_state(rank, state)

    def _stragglers(self, codes: list[int | None]) -> bool:
        self._rank0_done_at = self._rank0_done_at or time.monotonic()
        if time.monotonic() - self._rank0_done_at <= STRAGGLER_GRACE_S:
            return False
        self.result.lost += [r for r, c in enumerate(codes) if c is None and r not in self.result.lost]
        return True

    def _rank0_stalled(self, codes: list[int | None]) -> bool:
        if not (self.heartbeat and self.stall_s) or any(c is None for c in codes[1:]):
            self._beat = (self._beat[0], time.monotonic())
            return False
        try:  # rank 0 writes it, and touches it as it steps (runtime/dist.py, HEARTBEAT)
            stat = self.heartbeat.stat()
            size: tuple[int, int] = (stat.st_size, stat.st_mtime_ns)  # either changing is progress
        except FileNotFoundError:
            size = (0, 0)
        if size != self._beat[0]:
            self._beat = (size, time.monotonic())
            return False
        if time.monotonic() - self._beat[1] <= self.stall_s:
            return False
        self.procs[0].kill()
        self.procs[0].wait()
        self._beat = (self._beat[0], time.monotonic())
        if self.tolerate_loss and (self._restarts_left() or self.lose_rank0):
            return False  # treated as dead: replaced or lost below, like a killed one
        why = f"rank 0 wrote no progress for {self.stall_s:g} s after the other workers ended (timeout)"
        self.result.failed[0] = (1, f"parambox: error: {why}")
        self.result.returncode = 1
        return True

    def _job_stalled(self) -> bool:
        """An MPI job (one process for all its ranks) none of whose ranks touched its metrics file for
        twice ``stall_s`` and a margin (longer than the ranks' own timeouts, which name the peer):
        stopped. Counted only once a rank has trained in this job (not in start-up, nor on the
        metrics files a resumed run's earlier life left)."""
        if not self.stall_s:
            return False
        beats = []
        for path in self.job_dir.glob("metrics*.jsonl"):  # type: ignore[union-attr]
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                beats.append((path.name, st.st_size, st.st_mtime_ns))
        now, key = time.monotonic(), tuple(sorted(beats))
        if key != self._job_beat[0]:
            self._job_moved = self._job_moved or self._job_polled  # (a resume's files were there before)
            self._job_beat, self._job_polled = (key, now), True
            return False
        self._job_polled = True
        if not self._job_moved:
            return False
        limit = JOB_STALL_FACTOR * self.stall_s + JOB_STALL_MARGIN_S
        if now - self._job_beat[1] <= limit:
            return False
        _kill_session(self.procs[0])  # mpiexec leads a session of its own: its ranks are in it
        self.procs[0].wait()
        why = (
            f"no rank of the MPI job made progress for {limit:g} s (--timeout {self.stall_s:g}): a rank hangs"
        )
        self.result.failed[0] = (1, f"parambox: error: {why}; the job was stopped")
        self.result.returncode = 1
        return True

    # -- asynchronous: replace a dead worker, or go on without it ----------------------------------------
    def _replace_or_lose(self, rank: int, code: int) -> bool:
        """True if the run goes on (the rank was replaced, or is lost and is not rank 0). A user's error
        on any rank ends the run with its line: the rank's data would otherwise go untrained, silently."""
        if code == USER_ERROR:
            return False
        if self._restarts_left() and self._rank0_running(rank):
            self._start_replacement(rank)
            return True
        if rank == 0 and not self.lose_rank0:
            return False
        self._finished(rank, DEAD)
        self.result.lost.append(rank)
        return True

    def _start_replacement(self, rank: int) -> None:
        """A new life of ``rank`` (it attaches to the run's shared-memory boxes by name: a box-sync
        replacement takes the dead rank's slot in the box; an asynchronous one, the center)."""
        life = self.board.begin_life(rank) if self.board is not None else self.result.restarts + 1
        self.procs[rank] = self.starters.rank(rank, life)
        self._joining[rank] = life
        self.result.restarts += 1

    def _members_left(self, dead: int) -> bool:
        """A rank other than ``dead`` is a live member of the group that survives in place: one of the
        ranks that formed it, never replaced, or a replacement the group admitted (``admit/<rank>/<life>``
        in the store). Without one nobody admits a replacement: each waited its ``2 x --timeout`` for
        the word, died and was replaced again, for every restart left (``bench chaos --quick`` under
        load: a joiner given up on before its admission made the last members' new generation time
        out, and the run went on replacing for hours)."""
        store = self._life_store()
        formed = self.formed_at or len(self.procs)
        for r, proc in enumerate(self.procs):
            if r == dead or r in self.finished or r in self._fenced or proc.poll() is not None:
                continue
            life = self._joining.get(r)
            if life is None and r < formed:
                return True
            with contextlib.suppress(Exception):
                if store.check([f"admit/{r}/{self._group_life if life is None else life}"]):
                    return True
        return False

    def _rank0_running(self, rank: int) -> bool:
        # Once rank 0 has written the result, a replacement would train for nothing (a lost rank 0
        # left it to another worker).
        return rank == 0 or self.procs[0].poll() is None or 0 in self.result.lost

    def _restarts_left(self) -> bool:
        return self.result.restarts < self.max_restarts

    # -- synchronous, surviving in place: go on without the rank ------------------------------------------
    def _life_store(self) -> Any:
        from torch.distributed import PrefixStore

        # Each restart of the whole group starts the elastic protocol over, under a prefix of its own.
        return PrefixStore(f"life{self._group_life}", self.shrink_store)

    def _shrink(self, rank: int, code: int) -> bool:
        """True if the others go on without ``rank`` (see the module docstring)."""
        if self.shrink_store is None or code == USER_ERROR:
            return False
        from parambox.runtime.elastic import FORMED_KEY

        if self._life_store().add(FORMED_KEY, 0) < (self.formed_at or len(self.procs)):
            return False  # a rank died before every rank had joined: nobody can regroup (gloo#520)
        _kill_session(self.procs[rank])  # its loader processes hold its sockets: the peers see it gone now
        if not self._members_left(rank):
            return False  # nobody left to admit a replacement: the group restarts (or the run fails)
        if self._restarts_left():  # a replacement joins at a step boundary, state from a live rank
            self._start_replacement(rank)
            return True
        self._finished(rank, DEAD)
        self.result.lost.append(rank)
        return True

    def _kill_fenced(self, codes: list[int | None]) -> None:
        if self.shrink_store is None:
            return
        from parambox.runtime.elastic import fenced_ranks

        for rank in self._checked_ranks(fenced_ranks(self._life_store())):
            if rank not in self._fenced and codes[rank] is None:
                self._fenced.add(rank)
                _kill_session(self.procs[rank])  # its late messages go to a group nobody listens to

    def _checked_ranks(self, value: Any) -> list[int]:
        """Ranks read from the run's store: any local user can write it (torch's TCPStore has no
        password), so only a list of ranks of this run is taken."""
        if not isinstance(value, list):
            return []
        return [r for r in value if type(r) is int and 0 <= r < len(self.procs)]

    def _kill_stopped(self, codes: list[int | None]) -> None:
        """A rank that the kernel shows stopped for ``--timeout`` (``stall_s``) is SIGKILLed, in a run
        that survives in place (any rank: stalled past the others' timeout, it would be fenced out
        anyway) and in an asynchronous one (any rank while a replacement can be made, else
        one other than 0). A stopped process keeps the box's locks it held (an ``fcntl`` lock goes
        only with its process): every peer that needed one ran into its own timeout, died and was
        replaced, and its replacement again, for as long as the stop lasted (a 25 s SIGSTOP in
        ``bench chaos`` cost an asynchronous diloco run 15 lives of its other ranks). The
        peers' lock waits outlast ``--timeout`` (``box/shm.py``), so this kill comes first."""
        now = time.monotonic()
        watched = self.shrink_store is not None or self.tolerate_loss
        if not watched or not self.stall_s or now - self._stopped_at < STOPPED_EVERY_S:
            return
        self._stopped_at = now
        first = 0 if self.shrink_store is not None or self._restarts_left() or self.lose_rank0 else 1
        for rank in range(len(self.procs)):
            if (
                rank < first
                or codes[rank] is not None
                or rank in self._fenced
                or not is_stopped(self.procs[rank].pid)
            ):
                self._stopped_since.pop(rank, None)
                continue
            if now - self._stopped_since.setdefault(rank, now) >= self.stall_s:
                self._stopped_since.pop(rank)
                _kill_session(self.procs[rank])  # next poll: dead, and the others go on without it

    # -- synchronous: restart everyone from the last checkpoint -------------------------------------------
    def _group_restarts_for(self, rank: int) -> bool:
        """A death of ``rank`` restarts the whole group (with restarts left): any rank of a synchronous run."""
        return not self.tolerate_loss

    def _restart_group(self, rank: int, code: int) -> bool:
        if code == USER_ERROR or not self._restarts_left():
            return False
        cause = worker_error(self.log_dir, rank, code)  # before the stop: its peers' errors are symptoms
        self.starters.stop(self.procs)
        cause = f"{self.result.who(rank)} failed: {cause.removeprefix('parambox: error: ')}"
        kept = keep_life_logs(self.log_dir, self._group_life, cause)
        where = (
            "the last checkpoint" if self.starters.can_resume() else "step 0 (no checkpoint was written yet)"
        )
        warn(
            f"restarting the workers from {where} ({self.result.restarts + 1} of "
            f"{self.max_restarts}): {cause} (logs of that life: {kept})"
        )
        now = time.monotonic()
        self.result.earlier_lives_s += now - self._life_started
        self._life_started = now
        self.result.restarts += 1
        self._group_life = self.result.restarts
        self._joining.clear()
        self._job_polled = self._job_moved = False  # an MPI job's stall watch starts with the new job
        self.procs[:] = self.starters.group(self.result.restarts, self.starters.can_resume())
        self.finished.clear()
        return True

    def _fail(self, first: int) -> None:
        if self.muted is not None:
            self.muted.set()
        rank = root_cause(self.procs, self.log_dir, first)
        code = self.procs[rank].returncode
        self.result.failed[rank] = (code, worker_error(self.log_dir, rank, code))
        self.result.returncode = 1


def keep_life_logs(log_dir: Path, life: int, cause: str) -> Path:
    """Before a restart of the whole group: the ended ``life``'s error files and the ``cause`` of its
    end into ``logs/life{life}/`` (the new life's files are its own)."""
    dest = log_dir / f"life{life}"
    with contextlib.suppress(OSError):
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "restart.txt").write_text(cause + "\n")
        for err in log_dir.glob("rank*.err"):
            err.replace(dest / err.name)
    return dest


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a worker and what it started (data loader processes: they inherit its sockets, and keep
    a dead rank's connections open until their own watchdog notices, ~5 s later). Each worker leads a
    session of its own (``spawn.start``), so its process group is its id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# Errors a rank reports when a *peer* failed: they are symptoms, not the cause.
_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "timed out", "ranks not arrived")


def root_cause(procs: list[subprocess.Popen], log_dir: Path, first: int) -> int:
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
    if code == USER_ERROR:  # under mpiexec (one process for all ranks) another rank may have said why
        for other in sorted(log_dir.glob("rank*.err")):
            lines = other.read_text().strip().splitlines()
            if lines and lines[0].startswith("parambox: error: "):
                return lines[0]
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
