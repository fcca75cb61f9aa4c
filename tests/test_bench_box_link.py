"""Tier (c): `parambox bench box --emulate-nodes 2 --link-gbps 1 --quick --json` (issue 17): the memory
server moves each pushed and pulled byte over the link once, MPI's windows do not, and nothing is left
behind (namespaces, links, Open MPI's files).

Needs root and ip/tc/nsenter/unshare (skipped otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import MPI_ENV, run_cli
from tests.test_cluster import live_namespaces, needs_root, root_state

SHM = Path("/dev/shm")


@pytest.mark.solo  # looks at the whole machine
@pytest.mark.slow
@needs_root
@pytest.mark.timeout(300)
def test_bench_box_across_the_link_quick():
    pytest.importorskip("mpi4py")
    before, ns_before, shm_before = root_state(), live_namespaces(), set(SHM.iterdir())
    args = ["bench", "box", "--emulate-nodes", "2", "--link-gbps", "1", "--quick", "--json"]
    result = json.loads(run_cli(*args, env=MPI_ENV, timeout=290).stdout)
    ops = result["ops"]
    # One trip per byte: payload plus Ethernet/IP/TCP headers (1514/1448 = 1.046).
    for op in ("server_push", "server_pull"):
        assert 0.99 < ops[op]["link_bytes_per_byte"] <= 1.05, (op, ops[op])
        assert 0 < ops[op]["link_fraction"] < 1
    # Open MPI's accumulate over TCP is a get-modify-put: the push's bytes cross more than once.
    assert ops["windows_push"]["link_bytes_per_byte_both_ways"] > 2.0
    for key in ("mpi_allreduce", "gloo_allreduce"):
        assert result[f"server_push_pull_vs_{key}"] > 0
    assert root_state() == before and live_namespaces() <= ns_before
    assert set(SHM.iterdir()) <= shm_before


def test_link_options_belong_to_bench_box():
    proc = run_cli("bench", "sync", "--emulate-nodes", "2", check=False)
    assert proc.returncode == 2 and "bench box only" in proc.stderr
    proc = run_cli("bench", "box", "--link-gbps", "1", check=False)
    assert proc.returncode == 2 and "needs --emulate-nodes" in proc.stderr
