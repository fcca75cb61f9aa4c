"""What the launcher hears and bounds: a user's error on any rank of an asynchronous run ends it with that
line (exit 2), a hung rank 0 left alone is stopped, Ctrl-C leaves a checkpoint to resume from, and an
earlier life's error file cannot name the wrong cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parambox.training import checkpoint
from tests.conftest import MPI_ENV, ROOT, run_cli, summary

QUIET = ["--eval-every", "0", "--no-progress", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_user_error_on_rank_1_of_an_asynchronous_run_ends_it_with_exit_2(tmp_path):
    out = tmp_path / "r"
    args = ["--strategy", "easgd", "--workers", "2", "--model", "mlp", "--out", str(out), *QUIET]
    run_cli("train", *args, "--steps", "20", "--checkpoint-every", "10")
    states = sorted((out / "checkpoints").glob("rank1-step*.pt"))
    assert states, list((out / "checkpoints").iterdir())
    states[-1].write_bytes(b"not a checkpoint")  # rank 1's state, corrupt
    proc = run_cli("train", "--out", str(out), "--resume", "--steps", "30", *QUIET, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "(worker rank 1)" in proc.stderr and "lost worker" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_rank_0_is_lost_and_another_worker_writes_the_result(tmp_path):
    """Rank 0 hangs at step 5 of an asynchronous run: rank 1, done, finds it lost once its step count
    stood still for --timeout (lost_after_s) and takes the center; the launcher then stops the hung
    rank 0 (no progress for --timeout, the others ended). Exit 0, rank 0 lost (before: exit 1)."""
    out = tmp_path / "r"
    args = ["--strategy", "easgd", "--workers", "2", "--model", "mlp", "--out", str(out), *QUIET]
    start = time.monotonic()
    proc = run_cli("train", *args, "--steps", "40", "--timeout", "6", env={"PARAMBOX_FAULT": "0:5:hang"})
    assert "rank 0 is lost" in proc.stderr, proc.stderr
    s = summary(out)
    assert s["lost_workers"] == [0] and s["worker_steps"] == [5, 40], s
    assert time.monotonic() - start < 200


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_rank_0_left_alone_is_replaced_with_restarts_left(tmp_path):
    """The same hang (a SIGSTOP past --timeout looks the same) with --max-restarts: rank 1 has taken the
    result before the launcher sees rank 0 alone and hung; it kills and replaces it, and the
    replacement, finding the result taken, ends at once."""
    out = tmp_path / "r"
    args = ["--strategy", "easgd", "--workers", "2", "--model", "mlp", "--out", str(out), *QUIET]
    args += ["--steps", "40", "--timeout", "6", "--max-restarts", "1"]
    run_cli("train", *args, env={"PARAMBOX_FAULT": "0:5:hang"})
    s = summary(out)
    assert s["restarts"] == 1 and s["lost_workers"] == [0] and s["worker_steps"] == [5, 40], s


def _train_until_it_logs(strategy: str, out: Path) -> tuple[subprocess.Popen, Path]:
    """A 2-worker run that would go on for ever, once its metrics show it training."""
    cmd = [sys.executable, "-m", "parambox", "train", "--strategy", strategy, "--workers", "2"]
    cmd += ["--model", "mlp", "--steps", "100000", "--out", str(out), *QUIET]
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, **MPI_ENV}, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (metrics.exists() and metrics.stat().st_size > 2000) and time.monotonic() < deadline:
        time.sleep(0.2)
    return launcher, metrics


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce", "easgd"])
def test_ctrl_c_leaves_a_checkpoint_that_resume_continues(strategy, tmp_path):
    out = tmp_path / "r"
    launcher, metrics = _train_until_it_logs(strategy, out)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    last = checkpoint.load(out / "checkpoints" / "last.pt")
    assert last["step"] > 0
    proc = run_cli("train", "--out", str(out), "--resume", "--steps", str(last["step"] + 5), *QUIET)
    assert json.loads((out / "summary.json").read_text())["steps"] == last["step"] + 5, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_synchronous_rank_stopped_long_before_rank_0_waits_for_the_step_rank_0_names(tmp_path):
    """The race the Ctrl-C test can lose under load, made certain: rank 1 sees the stop 1.5 s (many
    steps) before rank 0. It must not leave on its own (rank 0 would then fail inside an allreduce and
    write no checkpoint): it trains on until rank 0 names the step, and both leave there."""
    from parambox.runtime.spawn import find_rank

    out = tmp_path / "r"
    launcher, metrics = _train_until_it_logs("allreduce", out)
    rank1 = find_rank(launcher.pid, 1)
    assert rank1 is not None
    rank1.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert launcher.poll() is None and rank1.is_running()  # it trains on, waiting for rank 0's word
    before = metrics.stat().st_size
    time.sleep(1.0)
    assert metrics.stat().st_size > before
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    last = checkpoint.load(out / "checkpoints" / "last.pt")
    assert (out / "checkpoints" / f"rank1-step{last['step']}.pt").exists()  # both left at one step


def test_a_stopped_rank_whose_board_is_gone_leaves_at_this_step():
    """Rank 0 hosts the board: once it has left at the step it named (the step before is collective,
    so the others are at that step too) a rank that looks then finds no board, and leaves there,
    saving its state, instead of failing (CI, under load: rank 0 saved and exited first)."""
    from types import SimpleNamespace

    from parambox.training.loop import STOP_KEY, _stops_here

    class Board:
        def __init__(self, gone: bool):
            self.gone, self.keys = gone, {}

        def check(self, keys):
            if self.gone:
                raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")
            return all(k in self.keys for k in keys)

        def get(self, key):
            return self.keys[key]

        def set(self, key, value):
            self.keys[key] = value

    def run(rank: int, store: Board):
        return SimpleNamespace(
            board=SimpleNamespace(store=store),
            strategy=SimpleNamespace(tolerates_worker_loss=False),
            world=SimpleNamespace(rank=rank),
        )

    live = Board(gone=False)
    assert _stops_here(run(0, live), 7) is False and live.keys == {STOP_KEY: "8"}  # rank 0 names 8
    assert _stops_here(run(1, live), 7) is False and _stops_here(run(1, live), 8) is True
    assert _stops_here(run(1, Board(gone=True)), 8) is True
    with pytest.raises(RuntimeError):  # rank 0 hosts the board: its own failure is not a stop
        _stops_here(run(0, Board(gone=True)), 8)


def test_an_earlier_lifes_error_file_is_removed_when_a_rank_starts(tmp_path):
    from parambox.run.plan import build
    from parambox.run.worker import train_rank
    from parambox.runtime.world import World

    (tmp_path / "logs").mkdir()
    stale = tmp_path / "logs" / "rank0.err"
    stale.write_text("parambox: error: an old cause\n")
    cfg = build({"strategy": "single", "workers": 1, "steps": 2, "eval_every": 0, "progress": False})
    train_rank(cfg, World.from_env({}), Path(tmp_path), resume=False)
    assert not stale.exists()


def test_a_rank_stopped_for_the_timeout_in_a_run_that_survives_in_place_is_killed(tmp_path):
    """Stalled past the others' timeout it would be fenced out anyway: killed at the timeout, its death
    ends the survivors' wait at once; rank 0 too (the oldest survivor then leads). A running rank and a
    stop shorter than the timeout stay."""
    from parambox.runtime.supervisor import Supervisor

    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(4)]  # as spawn.start
    try:
        # A timeout of 1 s, the early riser woken at 0.2 s: margins a loaded machine's late loop keeps.
        sup = Supervisor(procs, tmp_path, tolerate_loss=False, stall_s=1.0, shrink_store=object())
        for p in (procs[0], procs[2], procs[3]):
            p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        while (procs[0].poll() is None or procs[2].poll() is None) and time.monotonic() - t0 < 6:
            if time.monotonic() - t0 > 0.2:
                procs[3].send_signal(signal.SIGCONT)  # woke before the timeout
            sup._kill_stopped([p.poll() for p in procs])
            time.sleep(0.05)
        assert procs[2].wait(timeout=5) == procs[0].wait(timeout=5) == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert [p.poll() for p in (procs[1], procs[3])] == [None, None]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_run_that_survives_in_place_restarts_once_no_live_member_is_left_to_admit(tmp_path):
    """Every rank of the group dead or a replacement still waiting for its admission: nobody can admit
    them (each waits ``2 x --timeout``, dies, and was replaced again for every restart left: ``bench
    chaos --quick`` hung so under load). The whole group restarts instead; a replacement the group
    admitted is a member that admits the next one."""
    from torch.distributed import HashStore

    from parambox.runtime.elastic import FORMED_KEY
    from parambox.runtime.supervisor import Starters, Supervisor

    started: list[subprocess.Popen] = []

    def sleeper() -> subprocess.Popen:
        started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))  # as spawn.start
        return started[-1]

    def stop(procs: list[subprocess.Popen]) -> None:
        for p in procs:
            p.kill()
            p.wait()

    groups = []
    starters = Starters(
        group=lambda life, resume: groups.append(life) or [sleeper() for _ in range(3)],
        rank=lambda rank, life: sleeper(),
        stop=stop,
    )
    try:
        for admitted in (False, True):
            store, groups[:] = HashStore(), []
            procs = [sleeper() for _ in range(3)]
            sup = Supervisor(procs, tmp_path, False, starters=starters, max_restarts=10, shrink_store=store)
            sup._life_store().add(FORMED_KEY, 3)
            for rank in (1, 2):  # replaced: the original rank 0 is a member that admits them
                sup.procs[rank].kill()
                sup.procs[rank].wait()
                assert not sup._poll() and groups == [] and sup.result.restarts == rank
            if admitted:
                sup._life_store().set("admit/2/2", "{}")  # rank 2's replacement (its life 2) is in
            sup.procs[0].kill()
            sup.procs[0].wait()
            assert not sup._poll()
            assert groups == ([] if admitted else [3]), admitted  # life 3: the group's restart
            assert sup.result.restarts == 3 and all(p.poll() is None for p in sup.procs)
            stop(sup.procs)
    finally:
        stop(started)
