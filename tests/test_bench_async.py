"""Tier (c): `parambox bench async --json` runs and reports paired ratios (a smoke run; the figures
themselves are measured by running the benchmark, never asserted in a timed test)."""

from __future__ import annotations

import json

import pytest

from parambox.bench.asynchronous import RATIOS, summarize
from parambox.runtime.spawn import find_mpiexec
from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.long
def test_bench_async_smoke():
    proc = run_cli("bench", "async", "--json", "--rounds", "1", "--steps", "2")
    result = json.loads(proc.stdout)
    assert set(result["samples_per_s"]) >= {"plain", "hogwild"}
    for key in RATIOS:
        if key in result:
            assert result[key] > 0
    assert result["ratio_hogwild_vs_plain"] > 0
    assert result["plain_weights_shared"] is True  # the plain loop's two processes step one model
    if find_mpiexec():  # the price of the rma box's memory rank (issue 13)
        assert result["ratio_rma_memory_vs_sharded"] > 0
    assert result["nonfinite_setups"] == []


def test_summarize_takes_medians_of_paired_ratios():
    per_round = {"plain": [100.0, 200.0, 100.0], "hogwild": [110.0, 180.0, 100.0]}
    result = summarize(per_round, [], rounds=3, steps=1)
    assert result["ratio_hogwild_vs_plain"] == 1.0  # median of 1.1, 0.9, 1.0
    assert result["samples_per_s"] == {"plain": 100.0, "hogwild": 110.0}
    assert result["targets"]["ratio_hogwild_vs_plain"] == {"target": 1.0, "met": True}
    assert "ratio_easgd_tau1_vs_hogwild" not in result
