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


FOREIGN = """
import sys, torch.distributed as dist
from datetime import timedelta
store = dist.PrefixStore("life0", dist.TCPStore("127.0.0.1", int(sys.argv[1]), timeout=timedelta(seconds=10)))
print(sorted(store.underlying_store.list_keys()))  # nothing in the store is hidden from it
store.set("fenced", "[1]")
store.set("gen1/members", "[0]")
"""


def test_values_written_without_the_runs_secret_are_not_obeyed(monkeypatch):
    """Issue 53, S-A. Before: a local process that wrote ``fenced=[1]`` into the launcher's store of an
    ``on_failure=shrink`` run got rank 1 killed. The launcher hands its workers a secret; what they
    write is signed with it, and the launcher and the ranks refuse what is not."""
    from torch.distributed import PrefixStore

    from parambox.errors import CommTimeout
    from parambox.runtime import elastic, signed

    store, address = elastic.host_store()
    env = elastic.store_env(store, address)
    assert len(env[signed.SECRET_ENV]) == 32 and env[elastic.STORE_ENV] == address
    monkeypatch.delenv(signed.SECRET_ENV, raising=False)
    foreign = subprocess.run(  # another process, without the secret
        [sys.executable, "-c", FOREIGN, str(store.port)], capture_output=True, text=True, timeout=120
    )
    assert foreign.returncode == 0, foreign.stderr
    life = PrefixStore("life0", store)
    assert life.get("fenced") == b"[1]"  # it was written ...
    assert elastic.fenced_ranks(life) == []  # ... and the launcher does not kill rank 1 for it
    group = elastic.ElasticGroup(life, 1, 2, timeout_s=1.0, backend="gloo")
    with pytest.raises(CommTimeout, match="not signed"):
        group._get("gen1/members", wait_s=1.0)  # a rank does not take the forged members either
    # A worker of the run (the secret in its environment, a client of its own) is obeyed.
    monkeypatch.setenv(signed.SECRET_ENV, env[signed.SECRET_ENV])
    worker = PrefixStore("life0", elastic.connect_store(address, 10))
    signed.put(worker, elastic.FENCED_KEY, "[1]", env[signed.SECRET_ENV])
    assert elastic.fenced_ranks(life) == [1]
