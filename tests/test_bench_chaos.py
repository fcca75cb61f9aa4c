"""Tier (c): `parambox bench chaos --quick --json` runs both runs and reports its keys (the figures come
from the full form, run on a quiet machine: `parambox bench chaos --json`)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_chaos_quick():
    result = json.loads(run_cli("bench", "chaos", "--quick", "--json", timeout=390).stdout)
    assert {"clean", "chaos", "throughput_retained", "command_time_ratio", "kill_every_s"} <= set(result)
    chaos, steps = result["chaos"], result["steps"]
    assert chaos["kills"] >= 1 and chaos["restarts"] == chaos["kills"] and chaos["lost_workers"] == []
    assert chaos["worker_steps"] == [steps] * 3 == result["clean"]["worker_steps"]
    assert result["throughput_retained"] > 0 and chaos["final_test_accuracy"] > 0.8


def test_bench_quick_is_refused_where_there_is_none():
    proc = run_cli("bench", "box", "--quick", check=False)
    assert proc.returncode == 2 and "no --quick form" in proc.stderr
