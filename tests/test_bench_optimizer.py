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
