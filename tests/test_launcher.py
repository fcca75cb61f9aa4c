"""Tier (c): the local launcher stops everything promptly on a failure or Ctrl-C, and leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from parambox.errors import REQUEUE_EXIT
from tests.conftest import ROOT, run_cli

LONG = [
    "train",
    "--model",
    "mlp",
    "--steps",
    "1000000",
    "--eval-every",
    "0",
    "--no-progress",
    "--threads",
    "1",
]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(90)
def test_failed_worker_stops_the_others_and_is_named(tmp_path):
    t0 = time.monotonic()
    proc = run_cli(*LONG, "--out", str(tmp_path / "r"), env={"PARAMBOX_FAULT": "1:20:kill"}, check=False)
    assert proc.returncode == 1
    assert "worker rank 1 failed: killed by signal SIGKILL" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60  # a million steps would take far longer: the others were stopped


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name
)
def test_an_interrupt_stops_every_worker_after_its_checkpoint(tmp_path, short_tmp, sig):
    """Ctrl-C, ``kill`` (a batch system's time limit) or a closed terminal: the workers checkpoint,
    stop, and the run's temporary folder goes with them. SIGUSR1 (a batch system's warning before its
    time limit) too, with exit code 75: "requeue me"."""
    out = tmp_path / "r"
    p = subprocess.Popen(
        [sys.executable, "-m", "parambox", *LONG, "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TMPDIR=str(short_tmp)),
    )
    deadline = time.monotonic() + 60
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    workers = _descendants(p.pid)
    assert len(workers) >= 2
    assert list(short_tmp.glob("parambox-*"))  # the run's temporary folder
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    if sig == signal.SIGUSR1:
        assert p.returncode == REQUEUE_EXIT and "stopped for a requeue" in err, err
    else:
        assert p.returncode == 130 and "interrupted" in err
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    assert (out / "checkpoints" / "last.pt").exists()
    assert [p.name for p in short_tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_python_dash_m_and_help():
    proc = run_cli("--help")
    assert "train" in proc.stdout and "bench" in proc.stdout
    assert "Distributed training with any strategy" in proc.stdout and "``" not in proc.stdout
    assert "--strategy" in run_cli("train", "--help").stdout


@pytest.mark.parametrize("command", ["train", "sweep", "bench", "reproduce", "report", "pick", "predict"])
def test_a_commands_help_reads_as_text(command, capsys):
    """``--help`` prints the command's module docstring: without reST's literal markers."""
    from parambox.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"parambox {command}" in out and "``" not in out


def test_a_rendezvous_port_is_taken_below_the_ephemeral_range():
    """Outgoing connections take their local port from the ephemeral range: a rendezvous port from
    there can be taken by another run's client between the pick and the bind."""
    from parambox.runtime.spawn import _ephemeral_range, free_port

    low, _ = _ephemeral_range()
    if low <= 12000:
        pytest.skip("no room below this host's ephemeral range")
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1


def test_a_benchmark_whose_worker_fails_does_not_wait_on_the_others():
    """One worker fails; the other would wait for it (in a collective) for its full timeout."""
    from parambox.bench.workers import wait_all

    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    start = time.monotonic()
    codes = wait_all([failing, waiting], grace_s=0.5)
    assert codes == [3, -signal.SIGTERM]
    assert time.monotonic() - start < 10
