"""Tier (c): `parambox bench chaos --quick --json` runs every setup clean and under faults (a kill, a SIGSTOP
past --timeout, a kill before the first step) and reports its keys (the figures come from the full form,
run on a quiet machine: `parambox bench chaos --json`)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_chaos_quick():
    result = json.loads(
        run_cli("bench", "chaos", "--quick", "--timeout", "2.5", "--json", timeout=390).stdout
    )
    assert set(result["setups"]) == {"easgd", "diloco-async", "allreduce"}
    assert result["timeout"] == 2.5  # the runs' --timeout (the stops, 7 s, are past it)
    for name, r in result["setups"].items():
        faults = r["faults"]
        assert faults["kill-at-start"] == 1 and faults["kill"] >= 1 and faults["stop"] >= 1, (name, r)
        # every kill is replaced; a rank stopped past --timeout is killed by the launcher and replaced
        # too (a synchronous one fenced out first), or lost if the others finished meanwhile
        stopped = {f["rank"] for f in r["chaos"]["fault_log"] if f["kind"] == "stop"}
        if name in ("allreduce", "box-sync"):
            assert r["replacements"] >= 3 and r["chaos"]["lost_workers"] == [], (name, r)
        else:
            assert r["replacements"] >= 2 and set(r["chaos"]["lost_workers"]) <= stopped, (name, r)
        assert r["throughput_retained"] > 0 and r["accuracy_chaos"] > 0.8, (name, r)
        assert r["mean_recovery_s"] is not None and r["mean_recovery_s"] > 0, (name, r)
    bad = run_cli("bench", "chaos", "--quick", "--setups", "nope", check=False)
    assert bad.returncode == 2 and "unknown setups ['nope']" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_chaos_quick_box_sync_survives_in_place():
    """box-sync on request: a kill before its first step (a restart of all), a kill and a SIGSTOP
    survived in place, every one replaced, nobody lost."""
    result = json.loads(
        run_cli(
            "bench", "chaos", "--quick", "--setups", "box-sync", "--timeout", "2.5", "--json", timeout=190
        ).stdout
    )  # fmt: skip
    r = result["setups"]["box-sync"]
    assert r["faults"] == {"kill": 1, "stop": 1, "kill-at-start": 1}, r
    assert r["replacements"] >= 3 and r["chaos"]["lost_workers"] == [], r
    assert r["accuracy_chaos"] > 0.8 and r["mean_recovery_s"] > 0, r


def test_bench_quick_is_refused_where_there_is_none():
    proc = run_cli("bench", "box", "--quick", check=False)
    assert proc.returncode == 2 and "no --quick form" in proc.stderr
