"""Tier (c): `parambox bench sync --json` runs and reports paired ratios (a smoke run; the figures
themselves are measured by running the benchmark, never asserted in a timed test)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.timeout(120)
def test_bench_sync_smoke():
    proc = run_cli("bench", "sync", "--json", "--rounds", "1", "--steps", "2")
    result = json.loads(proc.stdout)
    for key in ("ratio_vs_ddp", "ratio_box_sync_vs_ddp", "ratio_box_sync_vs_ceiling"):
        assert result[key] > 0
    assert set(result["samples_per_s"]) == {"ddp", "allreduce", "box-sync", "ceiling"}


def test_bench_rejects_bad_rounds(capsys):
    from parambox.cli import main

    assert main(["bench", "sync", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
