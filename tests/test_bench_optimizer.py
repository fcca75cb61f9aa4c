"""Tier (c): `parambox bench optimizer --json` runs DistributedOptimizer(allreduce) and DDP side by
side and reports the paired ratio (a smoke run: figures come from running the benchmark)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_optimizer_smoke():
    proc = run_cli("bench", "optimizer", "--json", "--rounds", "1", "--steps", "2")
    result = json.loads(proc.stdout)
    assert set(result["samples_per_s"]) == {"ddp", "optimizer", "ceiling"}
    assert result["ratio_vs_ddp"] > 0 and result["ratio_ddp_vs_ceiling"] > 0


def test_a_hung_benchmark_worker_is_aborted_with_its_stack():
    """A smoke run past its deadline fails naming the hung worker, whose Python stack is on stderr."""
    import os
    import subprocess
    import sys

    from parambox.bench.workers import wait_all

    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    done = subprocess.Popen([sys.executable, "-c", "pass"], env=env)
    hung = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef waiting_forever():\n    time.sleep(60)\nwaiting_forever()"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with pytest.raises(RuntimeError, match=r"workers \[1\] still running after 1 s"):
        wait_all([done, hung], deadline_s=1.0)
    assert "waiting_forever" in hung.stderr.read()
    assert hung.returncode is not None
