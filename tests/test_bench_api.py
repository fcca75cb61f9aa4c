"""Tier (c): `parambox bench api --json` runs and reports its ratios (a smoke run; the figures are
measured by running the benchmark on a quiet machine, never asserted in a timed test)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_api_smoke():
    proc = run_cli("bench", "api", "--json", "--rounds", "1", "--steps", "2")
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert result["train_vs_plain_step_time"] > 0
    assert set(result["step_ms"]) == {"plain", "train", "fast", "slow", "slow_serial"}
    assert "hidden_fraction" in result["slow_dataset"]
