"""Tier (c): no run leaves anything in /dev/shm: not a normal one, not one whose worker was
SIGKILLed, not one stopped with SIGINT to the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.solo  # checks /dev/shm

SHM = Path("/dev/shm")
ARGS = [
    "train",
    "--strategy",
    "box-sync",
    "--model",
    "mlp",
    "--eval-every",
    "0",
    "--no-progress",
    "--threads",
    "1",
]


def _entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


@pytest.fixture
def shm_before():
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    return _entries()


@pytest.mark.timeout(120)
def test_normal_run(tmp_path, shm_before):
    run_cli(*ARGS, "--steps", "20", "--out", str(tmp_path / "r"))
    assert _entries() - shm_before == set()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkilled_worker(tmp_path, shm_before):
    proc = run_cli(
        *ARGS,
        "--steps",
        "100000",
        "--out",
        str(tmp_path / "r"),
        env={"PARAMBOX_FAULT": "1:30:kill"},
        check=False,
    )
    assert proc.returncode == 1 and "rank 1" in proc.stderr
    assert _entries() - shm_before == set()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_to_launcher(tmp_path, shm_before):
    out = tmp_path / "r"
    p = subprocess.Popen(
        [sys.executable, "-m", "parambox", *ARGS, "--steps", "1000000", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 60
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130
    assert _entries() - shm_before == set()
