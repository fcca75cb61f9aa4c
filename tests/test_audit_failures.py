"""The second audit's silent losses (issue 53): a user's ``sys.exit()``, a diverged run, two runs on
one run directory. Each ends non-zero with one line; before, each ended with exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parambox.cli import main
from parambox.runtime import zygote
from tests.conftest import one_line

TRAIN = ["train", "--strategy", "single", "--steps", "2", "--eval-every", "0", "--no-progress"]
DATA = "tests.workloads.user_regression:make_data"


EXITS = {
    "on_import": "import sys\nsys.exit(0)\n\ndef make_model():\n    pass\n",
    "in_factory": "import sys\n\ndef make_model():\n    sys.exit()\n",
    "in_factory_code_3": "import sys\n\ndef make_model():\n    sys.exit(3)\n",
}


@pytest.mark.parametrize("where", sorted(EXITS))
def test_a_users_sys_exit_is_a_failure(where, tmp_path, capsys):
    """Before: exit 0, silent, untrained (``SystemExit`` went past ``except Exception``)."""
    module = tmp_path / f"exits_{where}.py"
    module.write_text(EXITS[where])
    argv = [*TRAIN, "--model", f"{module}:make_model", "--data", DATA, "--out", str(tmp_path / "run")]
    assert main([*argv, "--loader-workers", "0"]) == 2
    line = one_line(capsys)
    assert "sys.exit" in line and ("make_model" in line if where != "on_import" else str(module) in line), (
        line
    )


def _strict_json(path):
    def refuse(constant):
        raise AssertionError(f"{path} holds a bare {constant}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _strict_json_line(line):
    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds a bare {constant}: not JSON: {line}")

    return json.loads(line, parse_constant=refuse)


def test_a_diverged_run_fails_naming_its_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    """Before: exit 0, ``summary.json`` with a bare NaN, ``last.pt`` silently at step 4 of 8."""
    monkeypatch.setenv("PARAMBOX_FAULT", "0:5:nan")  # NaN batches from step 5: the weights go NaN
    out = tmp_path / "run"
    assert main([*TRAIN[:4], "8", *TRAIN[5:], "--checkpoint-every", "2", "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("parambox: error: ") and "diverged" in last and "step 4" in last, last
    summary = _strict_json(out / "summary.json")
    assert summary["final_test_loss"] is None and summary["last_good_step"] == 4
    # metrics.jsonl too (before: bare NaN losses from step 5 on): a diverged step's loss is null
    steps = [_strict_json_line(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in steps if r["kind"] == "step"}
    assert losses[5] is not None and losses[6] is None and losses[8] is None, losses


def test_summary_json_is_json_whatever_it_holds(tmp_path):
    from parambox.training.checkpoint import atomic_write_json

    atomic_write_json(
        tmp_path / "s.json", {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}}
    )
    assert _strict_json(tmp_path / "s.json") == {"a": None, "b": [None, 1.5], "c": {"d": None}}


@pytest.mark.slow
def test_a_diverged_synchronous_run_leaves_no_pile_of_rank_files(tmp_path):
    """Before: exit 0, and rank 1's files of every checkpoint after the divergence stayed."""
    out = tmp_path / "run"
    argv = [*TRAIN[:2], "allreduce", "--workers", "2", *TRAIN[3:4], "8", *TRAIN[5:]]
    env = {**os.environ, "PARAMBOX_FAULT": "0:5:nan", "PYTHONPATH": str(Path(__file__).parents[1])}
    env |= zygote.shared_env()  # the workers fork warm from this session's zygote
    proc = subprocess.run(
        [sys.executable, "-m", "parambox", *argv, "--checkpoint-every", "2", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "step 4" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.pt", "rank1-step4.pt"]


@pytest.mark.slow
def test_a_run_directory_is_locked_by_the_run_that_owns_it(tmp_path, capsys):
    """Before: both runs passed the "already holds a run" check (nothing there yet), both exited 0, and
    the second replaced the first's result."""
    out = tmp_path / "run"
    env = {**os.environ, "PARAMBOX_FAULT": "0:0:slow", "PYTHONPATH": str(Path(__file__).parents[1])}
    first = subprocess.Popen(
        [sys.executable, "-m", "parambox", *TRAIN[:4], "200", *TRAIN[5:], "--out", str(out)],
        env=env,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (out / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        assert main([*TRAIN, "--out", str(out)]) == 2
        line = one_line(capsys)
        assert str(out) in line and "in use" in line and str(first.pid) in line, line
        assert main([*TRAIN, "--out", str(out), "--resume"]) == 2
        assert str(out) in one_line(capsys)
    finally:
        first.kill()
        first.wait()
    assert main([*TRAIN, "--out", str(tmp_path / "second")]) == 0  # the lock is released at the end
    assert main([*TRAIN, "--out", str(tmp_path / "second"), "--resume", "--steps", "3"]) == 0


def test_a_finished_run_leaves_no_lock_file(tmp_path):
    from parambox.run.rundir import LOCK_FILE

    assert main([*TRAIN, "--out", str(tmp_path / "run")]) == 0
    assert not (tmp_path / "run" / LOCK_FILE).exists()


@pytest.mark.slow
def test_train_with_workers_from_a_thread_other_than_the_main_one(tmp_path):
    """Before: ``ValueError: signal only works in main thread of the main interpreter``."""
    import threading

    import parambox

    got: dict = {}

    def run():
        try:
            got["result"] = parambox.train(
                strategy="allreduce",
                workers=2,
                steps=2,
                eval_every=0,
                progress=False,
                out=str(tmp_path / "run"),
            )
        except BaseException as e:  # noqa: BLE001  (reported below)
            got["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert "error" not in got, got.get("error")
    assert got["result"].steps == 2


@pytest.mark.slow
def test_a_synchronous_run_whose_rank_0_is_stopped_ends_within_its_timeout(tmp_path):
    """Before: it never ended, even with ``--timeout 4``: rank 1's timeout path blocked in
    ``TCPStore.check`` on the store a stopped rank 0 hosts."""
    argv = [*TRAIN[:2], "allreduce", "--workers", "2", *TRAIN[3:4], "50", *TRAIN[5:], "--timeout", "3"]
    err = run_bounded([*argv, "--out", str(tmp_path / "run")], "0:2:stop", 45, "the run", "3")
    assert "timed out: ranks not arrived: [0]" in err.strip().splitlines()[-1], err


@pytest.mark.slow
def test_a_slow_but_healthy_rank_0_is_not_killed_as_stalled(tmp_path):
    """Before: ``rank 0 wrote no progress for 3 s after the other workers ended``: its heartbeat was
    the size of metrics.jsonl, flushed every 50 steps."""
    argv = [*TRAIN[:2], "easgd", "--workers", "2", *TRAIN[3:4], "40", *TRAIN[5:], "--timeout", "3"]
    env = {**os.environ, "PARAMBOX_FAULT": "0:0:slow", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "parambox", *argv, "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 40


@pytest.mark.slow
def test_a_group_restart_says_its_cause_and_keeps_its_logs(tmp_path):
    """Before: the console said only "1 restart(s) of workers" and the first life's error files were
    deleted when the group restarted (an empty logs/)."""
    out = tmp_path / "run"
    argv = [*TRAIN[:2], "allreduce", "--workers", "2", *TRAIN[3:4], "8", *TRAIN[5:], "--max-restarts", "1"]
    env = {**os.environ, "PARAMBOX_FAULT": "1:3:kill", "PYTHONPATH": str(Path(__file__).parents[1])}
    env |= zygote.shared_env()  # both lives' workers fork warm from this session's zygote
    proc = subprocess.run(
        [sys.executable, "-m", "parambox", *argv, "--checkpoint-every", "2", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "worker rank 1 failed: killed by signal SIGKILL" in proc.stderr, proc.stderr
    assert "logs/life0" in proc.stderr and (out / "logs" / "life0").is_dir(), proc.stderr


@pytest.mark.slow
@pytest.mark.long
def test_an_mpi_job_whose_rank_0_hangs_is_stopped(tmp_path):
    """U2: an asynchronous ``--box rma`` run with a hung rank 0 never ended: the memory rank served on,
    and nothing watched mpiexec. Now the launcher stops a job none of whose ranks made progress for
    twice --timeout and a margin."""
    from parambox.runtime import spawn

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec")
    argv = [*TRAIN[:2], "easgd", "--box", "rma", "--workers", "2", *TRAIN[3:4], "10", *TRAIN[5:]]
    err = run_bounded(
        [*argv, "--timeout", "2", "--out", str(tmp_path / "run")], "0:3:hang", 50, "the MPI job", "2"
    )
    assert "no rank of the MPI job made progress" in err.strip().splitlines()[-1], err


class _Counters:
    """The box as a memory rank's serve loop sees it: counters, and MPI's word on failed ranks."""

    def __init__(self, num_counters: int):
        self.values = [0] * num_counters

    def read_counter(self, i: int) -> int:
        return self.values[i]

    def add_counter(self, i: int, v: int) -> int:
        self.values[i] += v
        return self.values[i] - v

    def set_counter(self, i: int, v: int) -> None:
        self.values[i] = v

    def failed_ranks(self) -> list[int]:
        return []


def _memory_rank(monkeypatch, num_workers: int = 2):
    from parambox.runtime.control import WorkerBoard
    from parambox.strategies.center import CounterMap
    from parambox.strategies.membership import Membership

    monkeypatch.setattr(WorkerBoard, "from_env", classmethod(lambda cls, env=None: None))  # mpiexec: no board
    m = CounterMap(num_workers + 1)
    box = _Counters(m.num_counters)
    members = Membership(box, m, num_workers, num_workers, 10, "all", lost_after_s=1.0)
    for r in range(num_workers):
        box.set_counter(m.ident(r), _host_bits() | os.getpid())  # alive: this process
    return members, box, m


def _host_bits() -> int:
    from parambox.runtime.spawn import process_identity

    return process_identity() >> 32 << 32


def _serve_bounded(members, deadline_s: float, limit: float = 30.0):
    """``members.serve(deadline_s)`` in a thread: what it raised (None: it returned), and its seconds."""
    import threading

    out: list = []

    def serve() -> None:
        try:
            members.serve(deadline_s=deadline_s)
            out.append(None)
        except Exception as e:
            out.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(limit)
    assert out, f"the serve loop did not end within {limit:g} s of a {deadline_s:g} s deadline"
    return out[0], time.monotonic() - start


def test_a_memory_rank_whose_workers_make_no_progress_stops_serving(monkeypatch):
    """U2, the serve loop itself: before, a memory rank whose rank 0 hung served until mpiexec was
    killed. Now, no step, status or start from any worker for ``deadline_s``: one line naming it."""
    from parambox.errors import CommTimeout

    members, _, _ = _memory_rank(monkeypatch)
    err, took = _serve_bounded(members, deadline_s=1.0)
    assert isinstance(err, CommTimeout) and "no worker made progress for 1 s" in str(err), err
    assert 1.0 <= took < 10.0, took


def test_a_memory_rank_serves_on_while_workers_step_and_ends_when_the_center_is_taken(monkeypatch):
    """Progress (steps) keeps it serving past its deadline; the leader's FINAL ends it cleanly."""
    import threading

    from parambox.strategies.center import FINAL

    members, box, m = _memory_rank(monkeypatch)

    def work() -> None:
        for _ in range(20):  # 2 s of steps, twice the deadline
            time.sleep(0.1)
            box.add_counter(m.steps(1), 1)
        box.add_counter(m.status(0), FINAL)

    threading.Thread(target=work, daemon=True).start()
    err, took = _serve_bounded(members, deadline_s=1.0)
    assert err is None and took >= 1.9, (err, took)


def test_a_memory_rank_whose_workers_are_all_gone_stops_at_once(monkeypatch):
    """Every worker's process exited and none took the center: it ends well before its deadline."""
    from parambox.errors import CommTimeout

    members, box, m = _memory_rank(monkeypatch)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    for r in range(2):
        box.set_counter(m.ident(r), _host_bits() | int(gone.stdout))
    err, took = _serve_bounded(members, deadline_s=60.0)
    assert isinstance(err, CommTimeout) and "every worker is gone" in str(err), err
    assert took < 10.0, took


def run_bounded(argv: list[str], fault: str, limit: float, what: str, timeout: str) -> str:
    """``parambox ARGV`` with ``PARAMBOX_FAULT=fault`` as a user runs it: it must end (exit 1) within
    ``limit`` seconds; its stderr."""
    env = {**os.environ, "PARAMBOX_FAULT": fault, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "parambox", *argv],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail(f"{what} did not end within {limit:g} s of a {timeout} s --timeout")
    assert proc.returncode == 1, err
    return err
