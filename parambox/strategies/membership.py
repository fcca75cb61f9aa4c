"""Who is in an asynchronous run, told by the box's counters: a worker's start, its counted steps, its
status (done, lost, non-finite, final), when to stop (ShmCaffe's termination alignment) and which
peers are lost. The update rules (``strategies/asynchronous.py`` and its subclasses) only train and
exchange; the box is the only channel, so a dead rank blocks nobody.

Start: rank 0 writes the initial center and bumps the ``ready`` counter; the others wait for that
alone. End: rank 0 waits for the others and takes the center (the run's result); the others wait for
that, and where rank 0 is lost first, the first of them to claim its part does it instead. Lost workers: a worker is lost at once when its launcher says it is dead (the local launcher's
board), when MPI says so (a memory rank marks it ``LOST`` in the box), or, with neither, when its
process on this host is gone; any worker once its step count stood still ``lost_after_s``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Callable

from parambox.box.base import Count, wait_until
from parambox.errors import CommTimeout, warn
from parambox.runtime.control import WorkerBoard
from parambox.runtime.spawn import identity_gone, is_stopped, process_identity
from parambox.strategies.center import DONE, FINAL, LOST, NONFINITE, RESUMED, CounterMap

_POLL_S = 0.01
# Steps whose counter adds may be under way at once. The others see a step's counts this many steps
# late at most (heartbeats allow seconds; termination counts this worker's own steps since).
COUNTS_IN_FLIGHT = 8
_RANK0_CLAIM = 1 << 20  # rank 0's claim of the lead in the ``lead`` counter; another worker's adds 1
_SERVE_POLL_S = 0.002  # a memory rank's pace: failures are noticed within a few ms of MPI knowing
_SERVE_LOOK_S = 0.2  # how often it reads every worker's counters for progress (one read per poll is rank 0's)

Seen = dict[int, tuple[int, float, int]]  # rank -> (its step count, when it last moved, its life)


class Membership:
    """One rank's view of the workers of an asynchronous run, through ``box``'s counters (``counters``).

    ``steps``: the target per worker; ``termination``: ``all`` | ``fastest`` | ``average``.
    """

    def __init__(
        self,
        box,
        counters: CounterMap,
        rank: int,
        num_workers: int,
        steps: int,
        termination: str,
        lost_after_s: float,
        spares: int = 0,
    ):
        self.box, self.m, self.rank, self.num_workers = box, counters, rank, num_workers
        self.spares = (
            spares  # box.spare_ranks: MPI ranks num_workers .. + spares - 1 wait to replace a worker
        )
        self.steps, self.termination, self.lost_after_s = steps, termination, lost_after_s
        self.board = WorkerBoard.from_env()  # the local launcher's word on dead peers
        self.lost: set[int] = set()
        self.reached = False  # this worker has done its steps (counted in ``reached``)
        # This worker's steps as counted in the box, and its counter adds in flight, per step (the
        # step's count, its adds): they travel while the next steps compute (across nodes each is a
        # trip over the link, queued behind whatever the exchange is sending; up to COUNTS_IN_FLIGHT).
        self.steps_done = 0
        # When rank 0 put the center in this box (microseconds): the box's identity, which a replica kept
        # when the box was lost names (training/salvage.py)
        self.born = 0
        self._counting: collections.deque[tuple[int, list[Count]]] = collections.deque()
        # What the last settled adds told of the run (termination alignment reads it, no trip of its
        # own): the run's total after that step's add, this worker's steps at it, and whether any
        # worker had reached its steps. None until a step's adds have settled.
        self._seen: tuple[int, int, bool] | None = None

    # -- start and resume ------------------------------------------------------------------------------
    def join(self, put_center: Callable[[], None]) -> None:
        """Rank 0 puts the initial center in the box (``put_center``, unless a previous life of it did),
        the others wait for that alone."""
        m = self.m
        self.box.set_counter(m.ident(self.rank), process_identity())
        if self.rank == 0 and self.box.read_counter(m.ready) == 0:
            put_center()
            self.box.set_counter(m.started, time.time_ns() // 1000)
            self.box.add_counter(m.ready, 1)
        else:
            self.await_ready(1)
        self.steps_done = self.box.read_counter(m.steps(self.rank))
        self.born = self.box.read_counter(m.started)

    def await_ready(self, generation: int) -> None:
        """Until rank 0 has put the center in the box (``generation`` 1) or back (2, resume): only
        rank 0 is waited for, so a worker that dies during start-up stalls nobody."""
        seen: Seen = {0: (-1, 0.0, 0)}

        def ready() -> bool:
            if self.box.read_counter(self.m.ready) >= generation:
                return True
            if self.is_lost(0, seen):
                raise CommTimeout("asynchronous start: rank 0 did not put the center weights in the box")
            return False

        wait_until(ready, float("inf"), lambda: "")

    def resume(self, done: int, put_back: Callable[[], None]) -> None:
        """A resumed life: this worker's ``done`` steps counted again; rank 0 puts the saved center
        back (``put_back``) and bumps ``ready``, the others wait for it. A replacement whose
        predecessor died while resuming does it again: what that one did is not done twice."""
        m = self.m
        counted = self.box.read_counter(m.steps(self.rank))  # a predecessor's count (0: none)
        if not self.box.read_counter(m.status(self.rank)) & RESUMED:
            self.box.add_counter(m.steps(self.rank), done - counted)
            self.box.add_counter(m.total, done - counted)
        self.steps_done = done
        # The samples counter starts afresh: samples_per_s is over this life's training time.
        if done >= self.steps:
            self.mark_reached()
        if self.rank == 0:
            if self.box.read_counter(m.ready) < 2:
                put_back()
                self.box.set_counter(m.started, time.time_ns() // 1000)  # this life's clock
                self.box.add_counter(m.ready, 1)
            self.set_status(0, RESUMED)
        else:
            self.set_status(self.rank, RESUMED)
            self.await_ready(2)
        self.born = self.box.read_counter(m.started)

    def resumed(self) -> bool:
        """This rank has been resumed in this run (its count carried on; rank 0: the center put back)."""
        return bool(self.box.read_counter(self.m.status(self.rank)) & RESUMED)

    def mark_reached(self) -> None:
        if not self.reached:
            self.reached = True
            self.box.add_counter(self.m.reached, 1)

    # -- steps ------------------------------------------------------------------------------------------
    def count_step(self, samples: int) -> None:
        """Count one step in the box (heartbeat, termination, the run's samples). The adds are taken in
        once back, waited for only when ``COUNTS_IN_FLIGHT`` steps' are under way (and at the end)."""
        m, rank = self.m, self.rank
        self.settle(in_flight=COUNTS_IN_FLIGHT - 1)
        self.steps_done += 1
        add = self.box.add_counter_async
        adds = [add(m.steps(rank), 1), add(m.total, 1), add(m.samples, samples)]
        if self.termination == "fastest":
            adds.append(add(m.reached, 0))  # a read that travels with the adds
        self._counting.append((self.steps_done, adds))
        if self.steps_done >= self.steps:
            self.mark_reached()

    def settle(self, in_flight: int = 0) -> None:
        """Take in the steps' adds that are back, oldest first, waiting for those beyond the newest
        ``in_flight`` steps' (at 0.1 Gbit/s a count queued behind an exchange's bytes must not stall
        the next step)."""
        while self._counting:
            steps, adds = self._counting[0]
            if len(self._counting) <= in_flight and not all(count.test() for count in adds):
                return
            _, total_before, _, *reached = [count.wait() for count in adds]  # in count_step's order
            self._seen = (total_before + 1, steps, bool(reached) and reached[0] > 0)
            self._counting.popleft()

    def should_stop(self, step: int) -> bool:
        """Termination alignment: ``all`` (each its own steps), ``fastest`` (once any worker has done
        its steps), ``average`` (once the workers' steps add up to every worker's target)."""
        target, mode = self.steps, self.termination
        if mode == "all" or self.num_workers == 1:
            return step >= target
        if mode == "fastest" and step >= target:
            return True
        if self._seen is None:  # no step's counts back yet: ask the box
            if mode == "fastest":
                return self.box.read_counter(self.m.reached) > 0
            return self.box.read_counter(self.m.total) >= target * self.num_workers
        # The counts as the last settled adds saw them (a step or two late, as heartbeats are), with
        # this worker's own steps since.
        total, mine, reached = self._seen
        if mode == "fastest":
            return reached
        return total + self.steps_done - mine >= target * self.num_workers

    # -- status ----------------------------------------------------------------------------------------
    def set_status(self, r: int, bit: int) -> None:
        if not self.box.read_counter(self.m.status(r)) & bit:
            self.box.add_counter(self.m.status(r), bit)

    def is_lost(self, r: int, seen: Seen) -> bool:
        """Dead (MPI or the launcher says so; without either, a local process that is gone), or its
        step count stood still ``lost_after_s``. A replacement under way counts as progress. With
        spare ranks, a death (MPI's word, a process gone) is the first memory rank's to act on (a
        spare's place, or ``LOST``, within milliseconds): a leader that saw it first would count lost a
        worker that a spare is taking over."""
        if self.box.read_counter(self.m.status(r)) & LOST or (not self.spares and self._dead_to_mpi(r)):
            return True
        life = 0
        if self.board is not None:
            if self.board.dead(r):
                return True
            life = self.board.life(r)
        elif not self.spares and identity_gone(self.box.read_counter(self.m.ident(r))):
            return True
        if self.spares:  # the MPI rank that runs it: a spare that took its place starts the clock again
            life = self.box.read_counter(self.m.proc(r))
        count, now = self.box.read_counter(self.m.steps(r)), time.monotonic()
        if (count, life) != (seen[r][0], seen[r][2]):
            seen[r] = (count, now, life)
            return False
        return now - seen[r][1] > self.lost_after_s

    def process_of(self, r: int) -> int:
        """The MPI rank that runs worker ``r``: ``r``, or the spare rank that took its place."""
        return (self.box.read_counter(self.m.proc(r)) or r + 1) - 1 if self.spares else r

    def _dead_to_mpi(self, r: int, failed: set[int] | None = None) -> bool:
        failed = set(self.box.failed_ranks()) if failed is None else failed
        return bool(failed) and self.process_of(r) in failed

    # -- the end ---------------------------------------------------------------------------------------
    def await_peers(self) -> None:
        """The leader (rank 0, or the worker that took over from it): until every other worker says
        DONE or is lost."""
        pending = set(range(self.num_workers)) - {self.rank} - self.lost
        seen: Seen = {r: (-1, 0.0, 0) for r in pending}
        while pending:
            for r in sorted(pending):
                if self.box.read_counter(self.m.status(r)) & DONE:
                    pending.discard(r)
                elif self.is_lost(r, seen):
                    pending.discard(r)
                    self.lost.add(r)
                    warn(f"worker rank {r} is lost (it died or stalled); finishing without it")
            if pending:
                time.sleep(_POLL_S)

    def serve(self, deadline_s: float) -> None:
        """A memory rank: drive MPI's progress and failure detection, and mark dead workers LOST in
        the box (the leader reads it), until the leader has taken the center (``FINAL``: rank 0, or
        the worker that took over from a lost rank 0) or every worker is lost. ``CommTimeout`` once
        every worker is gone without that, or none made progress (a step, a status, the start) for
        ``deadline_s``: a hung rank 0 does not keep this rank serving forever.

        >>> membership.serve(deadline_s=2 * timeout)  # doctest: +SKIP
        """
        # The first live memory rank keeps the book: the one writer of LOST bits and of the spares'
        # places; where a memory rank before it died (on one host the box outlives it), the next one
        # takes the book over from the box's counters.
        places: _Places | None = None
        fault_tolerant = getattr(self.box, "fault_tolerant", False)  # a dead rank does not end the job
        progress, moved, looked = None, time.monotonic(), 0.0
        while True:
            failed = self.box.failed_ranks()  # also drives MPI's progress and failure detection
            if places is None and self.keeps_places(failed):
                if self.rank > self.num_workers + self.spares:
                    warn(f"the memory ranks before rank {self.rank} died; it keeps the book of places")
                places = _Places(self, self.num_workers, self.spares)
            if places is not None:
                places.follow(failed)
            kills = places is not None and fault_tolerant  # stopped workers' processes
            status = self.box.read_counter(self.m.status(0))
            if status & FINAL or (status & LOST and self._all_lost()):
                if kills:  # the run is over: a worker stopped now would hold the job's end
                    places.kill_stopped(time.monotonic(), at_end=True)
                return
            now = time.monotonic()
            if now - looked >= _SERVE_LOOK_S:  # the counters all, a few times a second (not every poll)
                looked = now
                if kills:
                    places.kill_stopped(now)
                if self._all_gone():
                    raise CommTimeout(
                        f"memory rank {self.rank}: every worker is gone and none took the center; nothing left to serve"
                    )
                if (seen := self._progress()) != progress:
                    progress, moved = seen, now
                elif now - moved > deadline_s:
                    raise CommTimeout(
                        f"memory rank {self.rank}: no worker made progress for {deadline_s:g} s "
                        "(rank 0 hung or stopped?); it stops serving"
                    )
            time.sleep(_SERVE_POLL_S)

    def keeps_places(self, failed: list[int]) -> bool:
        """This memory rank keeps the book of places: every memory rank before it is dead to MPI."""
        return all(r in failed for r in range(self.num_workers + self.spares, self.rank))

    def spare_keeps_places(self, failed: list[int], memory: range) -> bool:
        """This waiting spare rank keeps the book of places: every memory rank (``memory``) is dead to
        MPI (on one host the box outlives them), and so is every spare before it still waiting (one
        that took a worker's place is that worker now, and a spare keeping the book waits on)."""
        dead, first = set(failed), self.num_workers
        return set(memory) <= dead and all(
            r in dead or self.box.read_counter(self.m.assign(r - first)) for r in range(first, self.rank)
        )

    def _progress(self) -> tuple[int, ...]:
        """What moves while any worker gets on: the start, each one's steps and status, the lead."""
        m, read = self.m, self.box.read_counter
        workers = range(self.num_workers)
        return (
            read(m.ready),
            read(m.lead),
            *(read(m.steps(r)) for r in workers),
            *(read(m.status(r)) for r in workers),
        )

    def _all_gone(self) -> bool:
        """Every worker dead for good: marked LOST, dead to MPI or the launcher, or (with neither) its
        process on this host exited. A replacement under way is not gone (the launcher's board)."""
        failed = set(self.box.failed_ranks())
        for r in range(self.num_workers):
            if self.box.read_counter(self.m.status(r)) & LOST or self._dead_to_mpi(r, failed):
                continue
            if self.board is not None:
                if not self.board.dead(r):
                    return False
            elif not identity_gone(self.box.read_counter(self.m.ident(r))):
                return False
        return True

    def await_leader(self) -> bool:
        """A worker other than rank 0, done: until rank 0 has taken the center (``FINAL``). True where
        rank 0 is lost first and this worker claimed its part (the first claim in the box's ``lead``
        counter): it leads then, and waits for the others itself. Rank 0 waiting for its peers (DONE)
        counts no steps: only its death (the launcher's word, or its process gone) makes it lost."""
        seen: Seen = {0: (-1, 0.0, 0)}
        while True:
            status = self.box.read_counter(self.m.status(0))
            if status & FINAL:
                return False
            if self._leader_lost(status, seen):
                if self.box.add_counter(self.m.lead, 1) % _RANK0_CLAIM != 0:
                    return False  # another worker claimed it first (a claim of rank 0's does not count: it is lost)
                self.lost.add(0)
                warn(f"rank 0 is lost (it died or stalled); rank {self.rank} takes the run's result")
                return True
            time.sleep(_POLL_S)

    def _leader_lost(self, status: int, seen: Seen) -> bool:
        if not status & DONE:
            return self.is_lost(0, seen)
        if status & LOST or self._dead_to_mpi(0):
            return True
        if self.board is not None:
            return self.board.dead(0)
        return bool(identity_gone(self.box.read_counter(self.m.ident(0))))

    def result_taken(self) -> bool:
        """Another worker took rank 0's part (rank 0 was lost): a replacement of rank 0 has nothing left
        to do."""
        return self.box.read_counter(self.m.lead) % _RANK0_CLAIM != 0

    def claim_lead(self) -> bool:
        """Rank 0 at its end: True unless another worker claimed its part first (rank 0 was taken for
        lost: a stall past ``lost_after_s``); only one of them writes the result. Rank 0's claims
        count apart (``_RANK0_CLAIM``): a replacement of a rank 0 that claimed, then died, leads."""
        return self.box.add_counter(self.m.lead, _RANK0_CLAIM) % _RANK0_CLAIM == 0

    def run_over(self) -> bool:
        """The leader took the run's result, or every worker is lost: nothing will need a spare."""
        status = self.box.read_counter(self.m.status(0))
        return bool(status & FINAL or (status & LOST and self._all_lost()))

    def _all_lost(self) -> bool:
        return all(self.box.read_counter(self.m.status(r)) & LOST for r in range(self.num_workers))

    def await_final(self) -> None:
        """A worker whose box shard lives in its own process: until rank 0 has read the center."""
        seen: Seen = {0: (-1, 0.0, 0)}
        while not self.box.read_counter(self.m.status(0)) & FINAL:
            if self.is_lost(0, seen):
                raise CommTimeout("asynchronous finish: rank 0 did not take the final center weights")
            time.sleep(_POLL_S)

    def summary(self) -> dict[str, object]:
        """The leader: the workers lost or halted on non-finite values, and every worker's step count."""
        m, n = self.m, self.num_workers
        out: dict[str, object] = {
            "workers": n,
            "lost_workers": sorted(self.lost),
            "nonfinite_workers": [r for r in range(n) if self.box.read_counter(m.status(r)) & NONFINITE],
            "worker_steps": [self.box.read_counter(m.steps(r)) for r in range(n)],
        }
        if self.spares:  # [worker, the MPI rank that runs it now] for each worker a spare replaced
            out["spare_ranks"] = self.spares
            out["replaced_by_spares"] = [[r, self.process_of(r)] for r in range(n) if self.process_of(r) != r]
            out["spares_used"] = sum(bool(self.box.read_counter(m.assign(i))) for i in range(self.spares))
        return out


def place(worker: int, life: int) -> int:
    """A spare's ``assign`` counter: the worker it replaces and that worker's life it starts (its
    ``k``-th replacement), in one int64 (0: no place yet).

    >>> place(1, 2), unplace(place(1, 2))
    (8589934594, (1, 2))
    """
    return life << 32 | (worker + 1)


def unplace(value: int) -> tuple[int, int]:
    return (value & 0xFFFFFFFF) - 1, value >> 32


class _Places:
    """The book of who runs each worker, kept by the first live memory rank (all dead: the first
    waiting spare). For each rank MPI says died, a worker's process gets a spare rank in its place (``box.spare_ranks``) while one is left and the worker was
    not done, else the worker is marked ``LOST``; a spare that died waiting is struck off."""

    def __init__(self, members: Membership, num_workers: int, spares: int):
        """The book as the box's counters tell it: at the start, or where the memory rank that kept it
        died (a place it had begun to give, its ``proc`` written and not its ``assign``, is given again)."""
        self.members, self.m, self.box = members, members.m, members.box
        given = [
            unplace(v) if (v := self.box.read_counter(self.m.assign(i))) else None for i in range(spares)
        ]
        self.runs = {r: members.process_of(r) for r in range(num_workers)}  # worker -> its MPI rank
        # worker -> its replacements so far (each spare that took a place took the worker's next life)
        self.lives = {r: sum(g is not None and g[0] == r for g in given) for r in range(num_workers)}
        running = set(self.runs.values())
        # MPI ranks of the waiting spares (not this one: a spare that keeps the book keeps only that)
        self.free = [
            r
            for i in range(spares)
            if given[i] is None and (r := num_workers + i) not in running and r != members.rank
        ]
        self.seen: set[int] = set()
        self.stopped: dict[int, float] = {}  # worker -> when its process was first seen stopped
        for worker, rank in self.runs.items():
            if rank == worker or given[rank - num_workers] is not None:
                continue
            if rank != members.rank:
                self._replace(worker, rank)
            elif self.free:  # half given to the spare that keeps the book now: the next spare's
                self._replace(worker, self.free.pop(0))
            else:
                members.set_status(worker, LOST)

    def follow(self, failed: list[int]) -> None:
        for rank in failed:
            if rank in self.seen:
                continue
            self.seen.add(rank)
            if rank in self.free:
                self.free.remove(rank)
                continue
            worker = next((w for w, p in self.runs.items() if p == rank), None)
            if worker is None or self.box.read_counter(self.m.status(worker)) & LOST:
                continue  # a memory rank, a process a spare replaced, or a worker already lost
            if self.free and not self.box.read_counter(self.m.status(worker)) & DONE:
                self._replace(worker, self.free.pop(0))
            else:
                self.members.set_status(worker, LOST)

    def _replace(self, worker: int, spare: int) -> None:
        m, box, index = self.m, self.box, spare - self.members.num_workers
        self.runs[worker] = spare
        self.lives[worker] += 1
        box.set_counter(m.proc(worker), spare + 1)
        box.set_counter(m.ident(worker), box.read_counter(m.spare_ident(index)))
        # last: the spare starts once the rest is true
        box.set_counter(m.assign(index), place(worker, self.lives[worker]))
        warn(f"worker rank {worker} died; spare rank {spare} takes its place")

    def kill_stopped(self, now: float, at_end: bool = False) -> None:
        """Under ``--with-ft ulfm``: SIGKILL a worker's process on this host that the kernel shows
        stopped (SIGSTOP, a suspended process); MPI then says it died, and ``follow`` gives its place to
        a spare or marks it LOST. Left alive it would stall the job's end until it wakes, and a done
        rank 0 its peers' wait for the result (the local launcher kills such a rank too). Killed once
        stopped for half of ``lost_after_s`` where a spare waits to take over (before a leader counts
        the worker lost), else for ``lost_after_s``; ``at_end`` (the result taken): at once."""
        m, box = self.m, self.box
        for worker in range(self.members.num_workers):
            ident, status = box.read_counter(m.ident(worker)), box.read_counter(m.status(worker))
            pid = ident & 0xFFFFFFFF
            if status & LOST or identity_gone(ident) is not False or not is_stopped(pid):
                self.stopped.pop(worker, None)  # lost, gone, on another host, or running
                continue
            since = self.stopped.setdefault(worker, now)
            # A done worker needs no spare (its death lets another lead, or the job end)
            limit = self.members.lost_after_s / (2 if self.free and not status & DONE else 1)
            if at_end or now - since >= limit:
                when = "at the run's end" if at_end else f"for {limit:g} s"
                warn(f"worker rank {worker} was stopped {when}; killing it (pid {pid})")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                del self.stopped[worker]
