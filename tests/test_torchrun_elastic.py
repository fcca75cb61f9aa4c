"""``torchrun --nnodes MIN:MAX`` (issue 50, item 2): a worker that torchrun's elastic agent restarts, on a
failure or because nodes joined or left, continues the run from its last checkpoint at the new size
with no ``--resume``, the resize recorded in ``metrics.jsonl``.

Tiers: (a) what makes a life a restart (``parambox/run/elastic.py``); (c) two agents on loopback: one
starts alone, the second joins (1 -> 2 workers), then the second is SIGKILLed (2 -> 1); every step is
counted once and both resizes are recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from parambox.errors import UserError
from parambox.run import elastic
from parambox.runtime.dist import check_store
from parambox.runtime.spawn import free_port
from parambox.training import checkpoint
from tests.conftest import ROOT, summary


def _env(run_id: str = "job-1", count: int = 0, port: int = 29500) -> dict[str, str]:
    return {
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(count),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


# -- (a) what a restart is -------------------------------------------------------------------------------------
def test_a_restart_count_above_zero_is_a_restart(tmp_path):
    assert elastic.is_restart(tmp_path, _env(count=1))
    assert not elastic.is_restart(tmp_path, _env(count=0))  # nothing recorded: a first life
    assert not elastic.is_restart(tmp_path, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_a_membership_restart_is_known_by_the_recorded_job(tmp_path):
    """A node joined or left: the count stays 0, the directory's record names the job."""
    elastic.record(tmp_path, _env("job-1", port=1111))
    assert elastic.is_restart(tmp_path, _env("job-1", port=2222))  # a new round's store, the same job
    assert not elastic.is_restart(tmp_path, _env("job-2", port=1111))  # another job: refused as before


def test_the_ranks_of_one_life_agree_while_they_write_the_record(tmp_path):
    """Rank 0 records the job before rank 1 reads it: the same store is the same life, not a restart
    (every torchrun run of two workers or more failed on this), and a later life's own record leaves
    the first life's store in place for its slower siblings."""
    elastic.record(tmp_path, _env("job-1", port=1111))
    assert not elastic.is_restart(tmp_path, _env("job-1", port=1111))
    elastic.record(tmp_path, _env("job-1", port=2222))  # the next life's rank 0
    assert elastic.is_restart(tmp_path, _env("job-1", port=2222))  # its rank 1, reading after


def test_the_default_run_id_is_a_restart_only_by_its_count(tmp_path):
    """``none`` (c10d's default --rdzv-id) is every such job's, and its agents share one store."""
    elastic.record(tmp_path, _env("none", port=1111))
    assert not elastic.is_restart(tmp_path, _env("none", port=1111))
    assert not elastic.is_restart(tmp_path, _env("none", port=2222))
    assert elastic.is_restart(tmp_path, _env("none", port=1111, count=1))


def test_a_restart_over_the_agents_shared_store_is_refused_in_one_line():
    """Its keys from the last life sent the rendezvous to the dead workers' addresses (a 30 s timeout)."""
    with pytest.raises(UserError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_store(2, {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    check_store(1, {"TORCHELASTIC_USE_AGENT_STORE": "True"})  # one worker meets nobody
    check_store(2, {"TORCHELASTIC_USE_AGENT_STORE": "False"})


def _prepare(out, monkeypatch, **env):
    from parambox.run.execute import prepare
    from parambox.run.plan import CLI, build

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **_env(**env)}.items():
        monkeypatch.setenv(k, v)
    return prepare(build({"model": "logreg", "out": str(out)}), CLI)[0]


def test_a_restart_before_the_first_checkpoint_starts_over_and_another_job_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert not _prepare(out, monkeypatch).restarted  # the first life records the job
    (out / "checkpoints").mkdir()  # it died before a checkpoint was committed
    plan = _prepare(out, monkeypatch, port=2222)  # a node joined: a new round, the same job
    assert plan.restarted and not plan.resume
    with pytest.raises(UserError, match="already holds a run; pass --resume"):
        _prepare(out, monkeypatch, run_id="job-2")


# -- (c) two agents on loopback --------------------------------------------------------------------------------
def _records(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what, proc: subprocess.Popen, deadline: float, describe: str):
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        assert proc.poll() is None, f"{describe}: the first agent exited {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{describe}: not within the time given")


def _kill(agent: subprocess.Popen) -> None:
    """An agent and its workers (which torch starts in sessions of their own)."""
    try:
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    agent.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.long
def test_a_node_joins_then_dies_and_the_run_finishes_at_each_size(tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    agent = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex,
        "--max-restarts", "3", "--monitor-interval", "0.2",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3",
    ]  # fmt: skip
    train = [
        "-m", "parambox", "train", "--model", "logreg", "--steps", "60", "--checkpoint-every", "5",
        "--checkpoint-interval-s", "0", "--eval-every", "0", "--no-progress", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    # Rank 0 sleeps 0.2 s a step, so that the second agent joins mid-run; the agents share no store
    # across rounds (torch issue 135712: its keys outlive a round, and a joining node waits forever).
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), PARAMBOX_FAULT="0:1:slow", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )

    def start(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.txt", "w")  # noqa: SIM115 (closed with the test's tmp_path)
        cmd = [*agent, "--log-dir", str(logs / name), *train]
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)

    first = start("first")
    second = None
    try:
        deadline = time.monotonic() + 200
        # the first trains alone; the workers torchrun then stops for the join checkpoint on its SIGTERM
        _wait(lambda: _records(out), first, deadline, "the first life")  # its "world" line
        second = start("second")
        grown = _wait(
            lambda: [r for r in _records(out) if r["kind"] == "resize" and r["to_workers"] == 2],
            first, deadline, "the resize to 2 workers",
        )[0]["step"]  # fmt: skip
        committed = lambda: (checkpoint.committed_step(out / "checkpoints") or 0) > grown  # noqa: E731
        _wait(committed, first, deadline, "a checkpoint at 2 workers")
        _kill(second)  # the agent and its worker: a node lost
        code = first.wait(timeout=deadline - time.monotonic())
        assert code == 0, (tmp_path / "first.txt").read_text()[-3000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                _kill(proc)
    records = _records(out)
    resizes = [(r["from_workers"], r["to_workers"]) for r in records if r["kind"] == "resize"]
    assert resizes == [(1, 2), (2, 1)]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert sorted(set(steps)) == list(range(1, 61))  # every step, none skipped
    result = summary(out)
    assert (result["steps"], result["workers"], result["launcher"]) == (60, 1, "torchrun")
    assert "resuming from step" in (tmp_path / "first.txt").read_text()
