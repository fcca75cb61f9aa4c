"""``parambox predict --nodes N``: parambox's setups ranked for a cluster (perfmodel/ranking.py), on the
user's model, as a user runs it."""

from __future__ import annotations

import json
import math

import pytest

from parambox.perfmodel.simulate import LINK_EFFICIENCY, PATTERNS
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


def test_predict_ranks_the_setups_for_nodes_of_several_workers():
    """4 workers on each of 2 nodes (--workers-per-node 4): the global batch of 1024 over the 8 workers
    (128 each), allreduce's ring over all 8 (2 x 7 rounds, each one hop across each node's link), ps-sync
    left out (simulated with one worker a node only)."""
    out = run_cli(
        "predict", "--model", "logreg", "--data", "digits", "--comp-table", "1:1,64:20,1024:300",
        "--bandwidth-gbps", "0.1", "--latency-us", "10", "--topology", "ring", "--max-workers", "8",
        "--nodes", "2", "--workers-per-node", "4", "--json",
    )  # fmt: skip
    s = json.loads(out.stdout)["setups"]
    assert (s["nodes"], s["workers_per_node"]) == (2, 4)
    by = {r["setup"]: r for r in s["ranking"]}
    assert set(by) == set(PATTERNS) - {"ceiling", "ddp", "post-local-sgd", "ps-sync"}
    compute = 20 * 2 ** (math.log(15) / math.log(16))  # 128 samples: log-log between 64:20 and 1024:300
    rate = 0.1e9 / 8 * LINK_EFFICIENCY
    ring = 2 * 7 * 10e-6 + 2 * 7 / 8 * 4 * 650 / rate  # one bucket: it starts once backward is done
    assert by["allreduce"]["compute_ms"] == pytest.approx(compute)
    assert by["allreduce"]["step_ms"] == pytest.approx(compute + 1e3 * ring)
    assert all(r["samples_per_s"] == pytest.approx(1024 / (r["step_ms"] / 1e3)) for r in by.values())


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--workers-per-node", "2"], "--workers-per-node W (>= 1) goes with --nodes N"),
        (
            ["--nodes", "2", "--workers-per-node", "2", "--simulate", "ps-sync"],
            "ps-sync is simulated with one",
        ),
    ],
)
def test_predict_workers_per_node_errors_are_one_line(extra, says):
    bad = run_cli("predict", "--comp-ms", "10", *extra, check=False)
    assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
