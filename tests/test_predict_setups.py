"""``parambox predict --nodes N``: parambox's setups ranked for a cluster (perfmodel/ranking.py), on the
user's model, as a user runs it."""

from __future__ import annotations

import json

import pytest

from parambox.perfmodel.simulate import PATTERNS
from tests.conftest import run_cli


def test_predict_ranks_every_setup_for_the_cluster_on_the_users_model():
    """logreg on digits' items (64 floats, 10 classes: 650 parameters), T_comp given, 4 nodes at 0.1
    Gbit/s: every setup but the ceiling and torch's DDP and PostLocalSGD, fastest first, each rate its
    global batch over its step."""
    out = run_cli(
        "predict", "--model", "logreg", "--data", "digits", "--comp-table", "1:1,64:20,1024:300",
        "--bandwidth-gbps", "0.1", "--topology", "ring", "--max-workers", "8", "--nodes", "4", "--json",
    )  # fmt: skip
    result = json.loads(out.stdout)
    s = result["setups"]
    assert s["nodes"] == 4 and s["scaling"] == "strong" and result["parameters"] == 650
    rows = s["ranking"]
    assert {r["setup"] for r in rows} == set(PATTERNS) - {"ceiling", "ddp", "post-local-sgd"}
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    rates = [r["samples_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True) and rows[0]["vs_fastest"] == 1.0
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(1024 / (r["step_ms"] / 1e3))
        assert r["step_ms"] == pytest.approx(r["compute_ms"] + r["comm_ms"])
        # 256 samples a node, log-log between 64:20 and 1024:300 ms: 20 x 4^(ln 15 / ln 16) = 20 sqrt(15)
        assert r["compute_ms"] == pytest.approx(20 * 15**0.5)
    by = {r["setup"]: r for r in rows}
    # an exchange every 16 steps moves a sixteenth of what one every step does, so it is faster here
    assert by["diloco"]["samples_per_s"] >= by["allreduce"]["samples_per_s"]
    assert "sim:allreduce" not in result["strong"]["topologies"]  # the ranking adds no curves


def test_predict_nodes_out_of_the_simulators_range_is_one_line():
    bad = run_cli("predict", "--nodes", "0", check=False)
    assert (
        bad.returncode == 2
        and "--nodes must be within 1..256" in bad.stderr
        and "Traceback" not in bad.stderr
    )
