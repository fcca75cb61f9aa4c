"""The run's TCPStores (rendezvous, progress board) listen on the master address alone, never on every
interface: they take no password (issue 21, security 1)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest

from parambox.runtime.dist import listening_store

EVERYWHERE = {"0.0.0.0", "::"}


def listening(proc: psutil.Process) -> list[str]:
    return [c.laddr.ip for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_a_store_listens_on_its_address_alone():
    store = listening_store("127.0.0.1", 0, 1, timedelta(seconds=5), wait=False)
    store.set("k", "v")
    mine = [c for c in psutil.Process().net_connections(kind="tcp") if c.laddr.port == store.port]
    assert [c.laddr.ip for c in mine if c.status == psutil.CONN_LISTEN] == ["127.0.0.1"]


@pytest.mark.timeout(180)
def test_a_local_run_listens_on_loopback_only(tmp_path):
    """Before: the rendezvous and board stores of rank 0 listened on ``::``."""
    cmd = [
        sys.executable,
        "-m",
        "parambox",
        "train",
        "--model",
        "mlp",
        "--steps",
        "3000",
        "--eval-every",
        "0",
    ]
    launcher = subprocess.Popen([*cmd, "--no-progress", "--out", str(tmp_path / "r")], stderr=subprocess.PIPE)
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "r" / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1.0)  # training: every store is up
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                seen.update(listening(child))
            except psutil.NoSuchProcess:
                pass
    finally:
        launcher.terminate()
        launcher.communicate(timeout=60)
    assert seen and not seen & EVERYWHERE, seen
