"""Tier (c): `parambox bench sync --json` runs and reports paired ratios (a smoke run; the figures
themselves are measured by running the benchmark, never asserted in a timed test)."""

from __future__ import annotations

import json

import pytest

from parambox.bench.peers import torchft_missing
from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_sync_smoke():
    proc = run_cli("bench", "sync", "--json", "--rounds", "1", "--steps", "2")
    result = json.loads(proc.stdout)
    keys = ["ratio_vs_ddp", "ratio_box_sync_vs_ddp", "ratio_box_sync_vs_ceiling"]
    for key in [*keys, "ratio_weight_avg_vs_post_local_sgd"]:
        assert result[key] > 0
    setups = {"ddp", "allreduce", "box-sync", "weight-avg", "post-local-sgd", "diloco", "ceiling"}
    if torchft_missing() is None:
        assert result["ratio_diloco_vs_torchft_diloco"] > 0
        setups.add("torchft-diloco")
    else:  # reported, with the reason
        assert result["ratio_diloco_vs_torchft_diloco"] is None and result["torchft_diloco_skipped"]
    assert set(result["samples_per_s"]) == setups


def test_bench_rejects_bad_rounds(capsys):
    from parambox.cli import main

    assert main(["bench", "sync", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
