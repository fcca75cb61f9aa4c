"""Spare ranks (``box.spare_ranks``): an MPI job's ranks that wait to take a dead worker's place.

Tier (a): the first memory rank's book of places (who runs each worker, which spares wait) over a
box of plain counters; the config's checks. Tier (c): ``parambox train --box rma`` with a spare, a
worker SIGKILLed half way: the spare takes its rank and does its steps, nobody is lost.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from contextlib import contextmanager

import pytest

from parambox.strategies.center import DONE, LOST, CounterMap
from parambox.strategies.membership import unplace
from tests.conftest import MPI_ENV, run_cli, summary
from tests.test_audit_failures import _Counters


class _Box(_Counters):
    """Counters, and MPI's word on failed ranks (settable)."""

    def __init__(self, num_counters: int):
        super().__init__(num_counters)
        self.failed: list[int] = []

    def failed_ranks(self) -> list[int]:
        return list(self.failed)


def _members(monkeypatch, workers: int = 2, spares: int = 2):
    """The first memory rank's view (MPI rank ``workers + spares``) and its book of places."""
    from parambox.runtime.control import WorkerBoard
    from parambox.strategies.membership import Membership, _Places

    monkeypatch.setattr(WorkerBoard, "from_env", classmethod(lambda cls, env=None: None))  # mpiexec
    m = CounterMap(workers, extra=1, spares=spares)
    box = _Box(m.num_counters)
    members = Membership(box, m, workers + spares, workers, 10, "all", 60.0, spares=spares)
    for i in range(spares):
        box.set_counter(m.spare_ident(i), 1000 + i)
    return members, _Places(members, workers, spares), box, m


def test_a_dead_worker_gets_the_first_waiting_spare_and_mpi_names_its_new_process(monkeypatch):
    members, places, box, m = _members(monkeypatch)
    box.failed = [1]
    places.follow(box.failed_ranks())
    assert unplace(box.read_counter(m.assign(0))) == (1, 1) and box.read_counter(m.assign(1)) == 0
    assert box.read_counter(m.proc(1)) == 3 and members.process_of(1) == 2  # MPI rank 2, + 1
    assert box.read_counter(m.ident(1)) == 1000  # the spare's identity: its process, not the dead one
    assert members.process_of(0) == 0
    assert not box.read_counter(m.status(1)) & LOST
    assert not members.is_lost(1, {1: (-1, 0.0, 0)})  # MPI rank 1 is dead, worker 1 is not
    places.follow(box.failed_ranks())  # the same death seen again: nothing more
    assert box.read_counter(m.assign(1)) == 0
    assert members.summary()["replaced_by_spares"] == [[1, 2]] and members.summary()["spares_used"] == 1


def test_the_spare_that_replaced_a_worker_dies_too_then_the_next_then_the_worker_is_lost(monkeypatch):
    members, places, box, m = _members(monkeypatch)
    box.failed = [1]
    places.follow(box.failed)
    box.failed = [1, 2]  # the process that ran worker 1 (MPI rank 2) died as well
    places.follow(box.failed)
    assert unplace(box.read_counter(m.assign(1))) == (1, 2) and members.process_of(1) == 3  # its life 2
    box.failed = [1, 2, 3]  # and the last spare: no one left to take its place
    places.follow(box.failed)
    assert box.read_counter(m.status(1)) & LOST
    assert members.is_lost(1, {1: (-1, 0.0, 0)})


def test_a_spare_that_died_waiting_is_struck_off_and_a_done_worker_is_not_replaced(monkeypatch):
    members, places, box, m = _members(monkeypatch)
    box.failed = [2]  # spare 0 died before anyone needed it
    places.follow(box.failed)
    box.set_counter(m.status(0), DONE)
    box.failed = [2, 0, 1]  # worker 0 after its last step, worker 1 while training
    places.follow(box.failed)
    assert box.read_counter(m.status(0)) & LOST and box.read_counter(m.assign(0)) == 0
    assert unplace(box.read_counter(m.assign(1))) == (1, 1) and members.process_of(1) == 3  # the second spare


def _next_keeper(box, m, workers: int = 2, spares: int = 2):
    """The second memory rank's view (MPI rank ``workers + spares + 1``)."""
    from parambox.strategies.membership import Membership

    return Membership(box, m, workers + spares + 1, workers, 10, "all", 60.0, spares=spares)


def test_the_next_memory_rank_takes_the_book_of_places_over_from_the_box(monkeypatch):
    """2 workers, spares at MPI ranks 2-3, memory ranks 4-5. Rank 4 gave worker 1's place to spare 2,
    then died: rank 5 reads the book from the box (worker 1 runs on rank 2 in its life 1, spare 3
    waits), acts on no death twice, and gives worker 1's next death to spare 3 as its life 2."""
    from parambox.strategies.membership import _Places

    _, places, box, m = _members(monkeypatch)
    box.failed = [1]
    places.follow(box.failed)
    box.failed = [1, 4]
    second = _next_keeper(box, m)
    assert second.keeps_places(box.failed) and not second.keeps_places([1])
    book = _Places(second, 2, 2)
    assert (book.runs, book.lives, book.free) == ({0: 0, 1: 2}, {0: 0, 1: 1}, [3])
    book.follow(box.failed)  # rank 1's death was acted on already; rank 4 is a memory rank
    assert box.read_counter(m.assign(1)) == 0 and not box.read_counter(m.status(1)) & LOST
    box.failed = [1, 4, 2]
    book.follow(box.failed)
    assert unplace(box.read_counter(m.assign(1))) == (1, 2) and second.process_of(1) == 3


def test_a_place_half_given_when_its_keeper_died_is_given_again(monkeypatch):
    """Rank 4 wrote worker 0's new process (spare 3) and died before the spare's ``assign``: the
    spare would wait for ever. The next keeper finishes the place, as worker 0's life 1."""
    from parambox.strategies.membership import _Places

    _, _, box, m = _members(monkeypatch)
    box.set_counter(m.proc(0), 3 + 1)
    book = _Places(_next_keeper(box, m), 2, 2)
    assert unplace(box.read_counter(m.assign(1))) == (0, 1) and box.read_counter(m.ident(0)) == 1001
    assert book.free == [2] and book.runs == {0: 3, 1: 1}


def _spare_view(box, m, rank: int, workers: int = 2, spares: int = 2):
    """A spare's view (MPI rank ``rank``, among ``workers .. workers + spares - 1``)."""
    from parambox.strategies.membership import Membership

    return Membership(box, m, rank, workers, 10, "all", 60.0, spares=spares)


def test_the_first_waiting_spare_keeps_the_book_once_every_memory_rank_died(monkeypatch):
    """2 workers, spares at MPI ranks 2-3, memory ranks 4-5: while a memory rank lives no spare keeps
    the book; once both died, spare 2 does (it is not a free spare of its own book), spare 3 waits for a
    place; spare 3 keeps it once spare 2 died too, or once spare 2 had taken a worker's place."""
    from parambox.strategies.membership import _Places

    _, _, box, m = _members(monkeypatch)
    memory = range(4, 6)
    first, second = _spare_view(box, m, 2), _spare_view(box, m, 3)
    assert not first.spare_keeps_places([4], memory) and not second.spare_keeps_places([4], memory)
    assert first.spare_keeps_places([4, 5], memory) and not second.spare_keeps_places([4, 5], memory)
    book = _Places(first, 2, 2)
    assert (book.runs, book.free) == ({0: 0, 1: 1}, [3])
    box.failed = [4, 5, 1]
    book.follow(box.failed)  # worker 1 died: the spare still waiting takes its place
    assert unplace(box.read_counter(m.assign(1))) == (1, 1) and first.process_of(1) == 3
    assert second.spare_keeps_places([4, 5, 2], memory)  # the keeper died
    box.set_counter(m.assign(1), 0)
    box.set_counter(m.assign(0), 7)  # spare 2 runs a worker: it is no longer a spare in the line
    assert second.spare_keeps_places([4, 5], memory)


def test_a_place_half_given_to_the_spare_that_keeps_the_book_goes_to_the_next_or_is_lost(monkeypatch):
    """The last memory rank wrote worker 1's new process (spare 2) and died before the spare's
    ``assign``: spare 2, keeping the book now, cannot also run worker 1, so spare 3 gets its place;
    with no spare left, worker 1 is lost."""
    from parambox.strategies.membership import _Places

    _, _, box, m = _members(monkeypatch)
    box.set_counter(m.proc(1), 2 + 1)
    book = _Places(_spare_view(box, m, 2), 2, 2)
    assert unplace(box.read_counter(m.assign(1))) == (1, 1) and box.read_counter(m.assign(0)) == 0
    assert book.runs == {0: 0, 1: 3} and book.free == []
    _, _, box, m = _members(monkeypatch, spares=1)
    box.set_counter(m.proc(1), 2 + 1)
    _Places(_spare_view(box, m, 2, spares=1), 2, 1)
    assert box.read_counter(m.status(1)) & LOST and box.read_counter(m.assign(0)) == 0


@contextmanager
def _processes(box, m, workers: int):
    """Each worker's process: a real one on this host (``sleep``), its identity in the box."""
    from parambox.runtime.spawn import process_identity

    procs = [subprocess.Popen(["sleep", "120"]) for _ in range(workers)]
    try:
        for r, proc in enumerate(procs):
            box.set_counter(m.ident(r), process_identity() >> 32 << 32 | proc.pid)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP, and on once the kernel shows it stopped (delivery is not instant)."""
    from parambox.box.base import wait_until
    from parambox.runtime.spawn import is_stopped

    proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: is_stopped(proc.pid), 10.0, lambda: "the process did not stop")


def test_a_stopped_worker_is_killed_half_way_to_lost_where_a_spare_waits_and_its_spare_gets_a_fresh_clock(
    monkeypatch,
):
    """lost_after_s 60: worker 1's process stopped at t=0 is SIGKILLed at t=30, before a leader would
    count it lost; MPI's word on its death then gives the place to a spare, whose clock starts afresh.
    Worker 0, running, is left alone."""
    members, places, box, m = _members(monkeypatch)
    with _processes(box, m, 2) as procs:
        _stop(procs[1])
        for now in (100.0, 129.9):
            places.kill_stopped(now)
        assert procs[1].poll() is None and procs[0].poll() is None
        places.kill_stopped(130.0)
        assert procs[1].wait(timeout=10) == -signal.SIGKILL and procs[0].poll() is None
        seen = {1: (0, 0.0, 0)}  # a leader's view: worker 1's count stood still since t=0 ...
        assert members.is_lost(1, seen)  # ... past lost_after_s: lost, had no spare taken over
        box.failed = [1]
        places.follow(box.failed)
        assert not members.is_lost(1, seen) and seen[1][2] == 3  # the spare (MPI rank 2) runs it now


def test_a_stopped_worker_with_no_spare_or_done_is_killed_at_lost_after_s(monkeypatch):
    for spares, done in ((0, False), (2, True)):
        members, places, box, m = _members(monkeypatch, spares=spares)
        with _processes(box, m, 2) as procs:
            box.set_counter(m.status(0), DONE if done else 0)
            _stop(procs[0])
            places.kill_stopped(0.0)
            places.kill_stopped(59.9)
            assert procs[0].poll() is None
            places.kill_stopped(60.0)
            assert procs[0].wait(timeout=10) == -signal.SIGKILL
            box.set_counter(m.status(1), LOST)  # a lost worker's process is not the book's to kill
            _stop(procs[1])
            places.kill_stopped(0.0)
            places.kill_stopped(1000.0)
            assert procs[1].poll() is None


def test_a_worker_stopped_when_the_result_is_taken_is_killed_at_once(monkeypatch):
    """The run is over (FINAL): a worker stopped now, however briefly, would hold the job's end until
    it wakes; a running one is left to end by itself."""
    members, places, box, m = _members(monkeypatch, spares=0)
    with _processes(box, m, 2) as procs:
        _stop(procs[1])
        places.kill_stopped(5.0, at_end=True)
        assert procs[1].wait(timeout=10) == -signal.SIGKILL and procs[0].poll() is None


def test_spare_ranks_are_refused_where_no_spare_can_take_a_place():
    from pydantic import ValidationError

    from parambox.box import BoxConfig

    assert BoxConfig(backend="rma", spare_ranks=2).options() == {}  # not open_box's option
    with pytest.raises(ValidationError, match="box.spare_ranks needs box.memory_ranks >= 1"):
        BoxConfig(backend="rma", spare_ranks=1, memory_ranks=0)
    with pytest.raises(ValidationError, match="not an option of the shm backend"):
        BoxConfig(spare_ranks=1)
    err = run_cli(
        "train", "--strategy", "allreduce", "--box", "rma", "--set", "box.spare_ranks=1", check=False
    )
    assert err.returncode == 2 and "box.spare_ranks: strategy 'allreduce' has no worker" in err.stderr
    assert "Traceback" not in err.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["easgd", pytest.param("downpour", marks=pytest.mark.long)])
def test_a_spare_rank_takes_the_place_of_a_killed_worker(tmp_path, strategy):
    """``--workers 2 --box rma --set box.spare_ranks=1``: ranks 0-1 train, rank 2 waits, rank 3 holds
    the box. Rank 1 SIGKILLed at step 100 of 300: the spare becomes worker 1, pulls the center, does
    the 200 steps it had not, and writes its checkpoints; no worker is lost."""
    out = tmp_path / "run"
    args = ["train", "--strategy", strategy, "--box", "rma", "--workers", "2", "--steps", "300"]
    args += ["--set", "box.spare_ranks=1", "--out", str(out), "--no-progress"]
    proc = run_cli(*args, env={**MPI_ENV, "PARAMBOX_FAULT": "1:100:kill"}, timeout=230)
    s = summary(out)
    assert (s["lost_workers"], s["worker_steps"], s["workers"]) == ([], [300, 300], 2)
    assert s["replaced_by_spares"] == [[1, 2]] and s["spare_ranks"] == 1 and s["memory_ranks"] == 1
    assert s["spares_used"] == 1
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
    assert "worker rank 1 died; spare rank 2 takes its place" in proc.stderr
    lives = [line for line in (out / "metrics.rank1.jsonl").read_text().splitlines() if '"world"' in line]
    assert len(lives) == 2 and '"from_spare": true' in lives[1] and '"step": 100' in lives[1]
    assert '"life": 1' in lives[1]  # a replacement: the fault of its predecessor's life is not its own


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_spare_rank_under_a_users_own_mpiexec(tmp_path):
    """`mpiexec --with-ft ulfm -n 4 ... --set box.spare_ranks=1`: the job's 4 ranks are 2 workers, the
    spare and the memory rank; rank 0 killed at step 100 of 300: the spare takes its place, writes the
    result and the run loses nobody."""
    from parambox.runtime.spawn import find_mpiexec

    out = tmp_path / "run"
    prefix = [find_mpiexec() or "mpiexec", "--with-ft", "ulfm", "-n", "4", "--oversubscribe"]
    args = ["train", "--strategy", "easgd", "--box", "rma", "--steps", "300", "--set", "box.spare_ranks=1"]
    args += ["--out", str(out), "--no-progress"]
    proc = run_cli(*args, prefix=prefix, env={**MPI_ENV, "PARAMBOX_FAULT": "0:100:kill"}, timeout=230)
    s = summary(out)
    assert (s["lost_workers"], s["worker_steps"], s["launcher"]) == ([], [300, 300], "mpi")
    assert s["replaced_by_spares"] == [[0, 2]] and s["workers"] == 2
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
    assert "worker rank 0 died; spare rank 2 takes its place" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "rank", "spares"),
    [  # the suite keeps one (~25 s each): the others run in the long tier, as CI runs both
        pytest.param("easgd", 1, 1, marks=pytest.mark.long),
        ("easgd", 1, 0),
        pytest.param("downpour", 0, 1, marks=pytest.mark.long),
    ],
)
def test_a_stopped_worker_is_killed_and_replaced_by_a_spare_or_lost(tmp_path, strategy, rank, spares):
    """A worker (rank 0, the leader, too) SIGSTOPs itself at step 100 of 300 and nobody wakes it
    (``--timeout 4``). The first memory rank SIGKILLs it: with a spare waiting after 2 s, and the spare
    does its 200 steps; with none after 4 s (or as the run ends, where the leader counted it lost
    first), and it is lost. Either way the job ends by itself (before, with no spare, the stopped rank
    held the job's end until the launcher stopped the whole job as hung)."""
    out = tmp_path / "run"
    args = ["train", "--strategy", strategy, "--box", "rma", "--workers", "2", "--steps", "300"]
    args += ["--timeout", "4", "--set", f"box.spare_ranks={spares}", "--out", str(out), "--no-progress"]
    proc = run_cli(*args, env={**MPI_ENV, "PARAMBOX_FAULT": f"{rank}:100:stop"}, timeout=230)
    s = summary(out)
    # with no spare, the leader may count it lost (after 4 s of no steps) before its kill: then it is
    # killed as the run ends
    when = "for 2 s" if spares else "(for 4 s|at the run's end)"
    assert re.search(f"worker rank {rank} was stopped {when}; killing it", proc.stderr), proc.stderr
    if spares:
        assert (s["lost_workers"], s["worker_steps"], s["replaced_by_spares"]) == (
            [],
            [300, 300],
            [[rank, 2]],
        )
    else:
        assert (s["lost_workers"], s["worker_steps"]) == ([1], [300, 100])
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]


def _memory_rank_then_worker_1_killed(tmp_path, memory_rank: int, *settings: str) -> tuple[dict, str]:
    """``parambox train --strategy easgd --box rma`` of 2 workers and 2000 steps with these ``--set``
    settings under mpiexec: MPI rank ``memory_rank`` SIGKILLed once the workers train, worker 1 at step
    1500. The run's summary and its stderr, once it ended with exit 0."""
    from tests.test_restarts import FAST, start, worker

    out = tmp_path / "run"
    args = ["train", "--strategy", "easgd", "--box", "rma", "--workers", "2", "--steps", "2000", *FAST]
    args += ["--timeout", "10", *(a for kv in settings for a in ("--set", kv)), "--out", str(out)]
    launcher = start(*args, env={**MPI_ENV, "PARAMBOX_FAULT": "1:1500:kill"})
    try:
        mine = out / "metrics.rank1.jsonl"
        deadline = time.monotonic() + 120
        while not (mine.exists() and '"step"' in mine.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker(launcher, memory_rank).kill()
        _, err = launcher.communicate(timeout=200)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    return summary(out), err


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_second_memory_rank_hands_out_the_places_once_the_first_died(tmp_path):
    """2 workers, a spare (rank 2), memory ranks 3 and 4 (``box.memory_ranks=2``). Rank 3 SIGKILLed
    once the workers train (on one host the box outlives it), then worker 1 SIGKILLed at step 1500 of
    2000: rank 4 keeps the book now and gives the place to the spare; nobody is lost."""
    s, err = _memory_rank_then_worker_1_killed(tmp_path, 3, "box.spare_ranks=1", "box.memory_ranks=2")
    assert (s["lost_workers"], s["worker_steps"], s["replaced_by_spares"]) == ([], [2000, 2000], [[1, 2]]), s
    assert "the memory ranks before rank 4 died; it keeps the book of places" in err
    assert "worker rank 1 died; spare rank 2 takes its place" in err


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_spare_keeps_the_book_once_the_one_memory_rank_died(tmp_path):
    """2 workers, spares at ranks 2 and 3, one memory rank (rank 4, the default). Rank 4 SIGKILLed once
    the workers train (on one host the box outlives it), then worker 1 SIGKILLed at step 1500 of 2000:
    spare 2 keeps the book now and gives the place to spare 3; nobody is lost."""
    s, err = _memory_rank_then_worker_1_killed(tmp_path, 4, "box.spare_ranks=2")
    assert (s["lost_workers"], s["worker_steps"], s["replaced_by_spares"]) == ([], [2000, 2000], [[1, 3]]), s
    assert "every memory rank died; spare rank 2 keeps the book of places" in err
    assert "worker rank 1 died; spare rank 3 takes its place" in err
