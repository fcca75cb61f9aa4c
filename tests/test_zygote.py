"""Warm starts (``parambox.runtime.zygote``): a forked child sees what a fresh interpreter would, its
exit code and streams reach the caller, and it dies with the process that asked for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import torch

from parambox.runtime import spawn, zygote
from tests.conftest import ROOT, final_weights, run_cli, summary


def test_a_forked_child_gets_its_env_cwd_argv_streams_and_exit_code(tmp_path):
    env = dict(os.environ, ZYGOTE_PROBE="yes", PYTHONPATH=str(ROOT), PARAMBOX_STRATEGIES="toyz=m:C")
    os.chdir(tmp_path)
    try:
        proc = spawn.start(
            [sys.executable, "-m", "tests.zygote_child", "3"],
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    finally:
        os.chdir(ROOT)
    assert isinstance(proc, zygote.Forked)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.wait(30) == 3 and proc.returncode == 3
    seen = json.loads(out)
    assert seen["argv"] == ["3"] and seen["probe"] == "yes" and seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(tmp_path)  # as `python -m` run there puts it
    assert seen["session_leader"] and seen["torch_loaded"]
    assert seen["strategy"] == "m:C"  # the registry read from the child's environment, not the zygote's
    assert err == b"to stderr\n"


def test_a_forked_child_dies_with_the_process_that_asked_for_it(tmp_path):
    """The requester SIGKILLed: its connection closes, and the zygote kills what it forked for it."""
    script = (
        "import subprocess, sys\n"
        "from parambox.runtime import spawn\n"
        "p = spawn.start([sys.executable, '-m', 'tests.zygote_child', 'sleep'], dict(__import__('os').environ), stdout=subprocess.PIPE)\n"
        "print(p.pid, type(p).__name__, flush=True)\n"
        "p.stdout.readline()\n"
        "print('running', flush=True)\n"
        "import time; time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), **zygote.shared_env())  # this session's zygote
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    pid, kind = owner.stdout.readline().split()
    assert kind == "Forked"
    assert owner.stdout.readline().strip() == "running"
    child = psutil.Process(int(pid))
    assert child.ppid() == zygote.pid()
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    child.wait(10)  # raises TimeoutExpired if it lives on
    assert not psutil.pid_exists(int(pid)) or child.status() == psutil.STATUS_ZOMBIE


def test_a_run_forked_warm_ends_bit_for_bit_where_a_fresh_one_does(tmp_path):
    args = ["train", "--strategy", "allreduce", "--workers", "2", "--no-progress", "--threads", "1"]
    for name, env in (("warm", {}), ("fresh", {zygote.ENV: "0"})):
        run_cli(*args, "--set", "steps=30", "--out", str(tmp_path / name), env=env)
        assert summary(tmp_path / name)["steps"] == 30
    warm, fresh = final_weights(tmp_path / "warm"), final_weights(tmp_path / "fresh")
    assert all(torch.equal(warm[k], fresh[k]) for k in fresh)


def test_the_cli_starts_its_zygote_early_only_where_it_will_fork_workers(monkeypatch):
    from parambox.cli import _spawns_local_workers

    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert _spawns_local_workers(["train", "--strategy", "easgd"])  # 2 workers by default
    assert not _spawns_local_workers(["train", "--workers", "1"])
    assert not _spawns_local_workers(["train", "--box", "rma"])  # mpiexec starts the ranks
    assert not _spawns_local_workers(["train", "--emulate-nodes", "2"])
    assert not _spawns_local_workers(["pick"])
    monkeypatch.setenv("RANK", "0")  # under torchrun: this process is a rank
    assert not _spawns_local_workers(["train"])


def test_a_forked_child_runs_torch_on_the_threads_its_environment_asks_for():
    """The zygote imports torch on one OpenMP thread (so that no libgomp pool exists to be forked);
    the child gets OMP_NUM_THREADS's count back, and a parallel region runs on it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    proc = spawn.start([sys.executable, "-m", "tests.zygote_child", "threads"], env, stdout=subprocess.PIPE)
    assert isinstance(proc, zygote.Forked)
    assert proc.wait(60) == 0
    lines = proc.stdout.read().decode().splitlines()
    threads, total = lines[-1].split()
    assert int(threads) == 2 and float(total) == 512.0**3
