"""Time to accuracy (issue 11 item 3) and ``parambox reproduce`` (item 4): the maths of time to accuracy,
every claim's verdict rule on given numbers, and the quick forms run as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from parambox.errors import UserError
from parambox.studies import reproduce as rp
from parambox.studies.accuracy import (
    best_vs_baseline,
    default_setups,
    first_crossing,
    lr_for,
    median_time,
    plan,
    training_clock,
)
from parambox.studies.reproduce import linear_fit
from tests.test_cluster import needs_root

pytestmark = pytest.mark.timeout(240)

# -- time to accuracy: the maths -------------------------------------------------------------------


def test_training_clock_takes_evaluations_out():
    steps = [{"step": s, "time": t} for s, t in ((10, 1.0), (20, 3.5), (30, 6.0))]
    evals = [
        {"step": 10, "time": 1.5, "test_accuracy": 0.5},  # 0.5 s of evaluation
        {"step": 20, "time": 4.5, "test_accuracy": 0.8},  # 1.0 s
        {"step": 30, "time": 6.2, "test_accuracy": 0.9},
    ]
    assert training_clock(steps, evals) == [(1.0, 0.5), (3.0, 0.8), (4.5, 0.9)]


def test_first_crossing_is_the_first_evaluation_at_or_above_the_target():
    points = [(1.0, 0.90), (2.0, 0.98), (3.0, 0.97), (4.0, 0.99)]
    assert first_crossing(points, 0.98) == 2.0
    assert first_crossing(points, 0.995) is None
    assert first_crossing([], 0.5) is None


@pytest.mark.parametrize(
    "times, median",
    [
        ([3.0, 1.0, 2.0], 2.0),
        ([3.0, None, 5.0], 5.0),  # a miss counts as infinitely slow
        ([None, None, 5.0], None),  # most seeds missed: no median
        ([4.0, 2.0], 3.0),
        ([4.0, None], None),
        ([], None),
    ],
)
def test_median_over_seeds(times, median):
    assert median_time(times) == median


def test_best_against_the_baseline():
    assert best_vs_baseline({"allreduce": 10.0, "a": 8.0, "b": 5.0}, "allreduce") == ("b", 0.5)
    assert best_vs_baseline({"allreduce": None, "a": 8.0}, "allreduce") == ("a", None)
    assert best_vs_baseline({"allreduce": 10.0, "a": None}, "allreduce") == (None, None)


def test_learning_rate_rule_and_plan():
    assert lr_for("downpour", 0.04, 2) == 0.02 and lr_for("hogwild", 0.04, 4) == 0.01
    assert lr_for("easgd", 0.04, 2) == lr_for("allreduce", 0.04, 2) == 0.04
    assert "allreduce" in default_setups() and "ddp" not in default_setups()
    base = {"workers": 2, "model": "lenet", "data": "digits", "steps": 10, "lr": 0.04, "threads": 1}
    runs = plan(base, ["allreduce", "downpour"], [1.0, None], [0, 1], nodes=2)
    assert [r.name for r in runs][:2] == ["1gbps-allreduce-s0", "1gbps-allreduce-s1"]
    assert runs[0].config["cluster"] == {"nodes": 2, "link_gbps": 1.0} and "cluster" not in runs[-1].config
    assert runs[2].config["strategy"] == "downpour" and runs[2].config["lr"] == 0.02
    rma = plan(base, ["easgd-tau4"], [1.0], [0], nodes=2)[0].config["box"]
    assert rma == {"backend": "rma", "memory_ranks": 0}  # one worker per node: no memory rank
    with pytest.raises(UserError, match="unknown setups"):
        plan(base, ["ddp"], [1.0], [0], nodes=2)


# -- reproduce: each verdict rule on given numbers -------------------------------------------------


def test_linear_fit():
    slope, r2 = linear_fit([2, 3, 4], [1.0, 2.1, 2.9])
    assert slope == pytest.approx(0.95) and r2 > 0.98


@pytest.mark.parametrize(
    "roughness, loss, verdict",
    [
        ([0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], "reproduced"),
        ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], "partly"),
        ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], "not reproduced"),
    ],
)
def test_verdict_neuron(roughness, loss, verdict):
    assert rp.verdict_neuron({"roughness": roughness, "final_loss": loss})[0] == verdict


def _w(batch, lr=0.1):
    return {"batch_size": batch, "lr": lr, "area": 1.0}


@pytest.mark.parametrize(
    "winners, verdict",
    [
        ({"1": _w(32), "2": _w(16)}, "reproduced"),
        ({"1": _w(16), "2": _w(32)}, "partly"),
        ({"1": _w(16), "2": None}, "partly"),
        ({"1": None, "2": None}, "not reproduced"),
    ],
)
def test_verdict_grid(winners, verdict):
    assert rp.verdict_grid({"winners": winners})[0] == verdict


@pytest.mark.parametrize(
    "average, gather, verdict",
    [
        ([1.0, 2.0, 3.0], [5.0, 2.0, 4.0], "reproduced"),
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], "partly"),
        ([3.0, 1.0, 2.0], [1.0, 2.0, 3.0], "not reproduced"),
    ],
)
def test_verdict_phases(average, gather, verdict):
    m = {"workers": [2, 3, 4], "ms_per_step": {"average": average, "gather": gather, "broadcast": gather}}
    assert rp.verdict_phases(m)[0] == verdict


def test_verdict_phases_without_timings():
    m = {"workers": [2], "ms_per_step": {"average": [1.0], "gather": [1.0], "broadcast": [1.0]}}
    assert rp.verdict_phases(m)[0] == "not reproduced"


@pytest.mark.parametrize(
    "gain, verdict",
    [([1.0, 3.0, 2.0], "reproduced"), ([1.0, 2.0, 3.0], "partly"), ([3.0, 2.0, 1.0], "not reproduced")],
)
def test_verdict_gain(gain, verdict):
    assert rp.verdict_gain({"workers": [1, 2, 4], "accuracy_pts_per_s": gain})[0] == verdict


@pytest.mark.parametrize(
    "hybrid, easgd, verdict", [(1.0, 4.0, "reproduced"), (1.0, 1.5, "partly"), (4.0, 1.0, "not reproduced")]
)
def test_verdict_hybrid(hybrid, easgd, verdict):
    m = {"points_lost_vs_allreduce": {"hybrid": hybrid, "easgd": easgd}}
    assert rp.verdict_hybrid(m)[0] == verdict


def _tau(easgd, eamsgd, downpour):
    taus = ["1", "4", "16", "64"]
    return {
        "taus": [1, 4, 16, 64],
        "test_accuracy_pct": {
            "easgd": dict(zip(taus, easgd)),
            "eamsgd": dict(zip(taus, eamsgd)),
            "downpour": dict(zip(taus, downpour)),
        },
    }


@pytest.mark.parametrize(
    "table, verdict",
    [
        (_tau([95, 95, 94.5, 94.5], [96, 96, 96, 95], [95, 93, 90, 80]), "reproduced"),
        (_tau([95, 95, 94.5, 94.5], [90, 90, 90, 90], [95, 93, 90, 80]), "partly"),
        (_tau([95, 93, 90, 80], [90, 88, 85, 75], [95, 95, 95, 95]), "not reproduced"),
    ],
)
def test_verdict_tau(table, verdict):
    assert rp.verdict_tau(table)[0] == verdict


@pytest.mark.parametrize("speedup, verdict", [(2.1, "reproduced"), (1.5, "partly"), (0.9, "not reproduced")])
def test_verdict_smb(speedup, verdict):
    assert rp.verdict_smb({"speedup": speedup, "size_mb": 100})[0] == verdict


@pytest.mark.parametrize(
    "one_node, across, verdict",
    [(2.1, 2.03, "reproduced"), (2.1, 1.5, "partly"), (0.9, 0.8, "not reproduced"), (0.9, 2.2, "partly")],
)
def test_verdict_smb_on_one_node_and_across_a_link(one_node, across, verdict):
    link = {"link_gbps": 1.0, "size_mb": 32, "speedup": across}
    got, why = rp.verdict_smb({"speedup": one_node, "size_mb": 100, "across_link": link})
    assert got == verdict and "one node" in why and "across a 1 Gbit/s link" in why
    skipped = rp.verdict_smb(
        {"speedup": one_node, "size_mb": 100, "across_link": {"skipped": "the quick form"}}
    )
    assert skipped[0] == rp.verdict_smb({"speedup": one_node, "size_mb": 100})[0]
    assert "across a link: not measured (the quick form)" in skipped[1]


def test_the_smb_claim_across_a_link_reads_bench_box_link(monkeypatch, tmp_path):
    """The full form runs `bench box --emulate-nodes 2` and reads the memory server's fused push-pull
    against MPI_Allreduce; the quick form and a run without root leave it out, saying why."""
    figures = {
        "size_mb": 32,
        "ops": {"server_push_pull_fused": {"ms": 291.0}, "mpi_allreduce": {"ms": 591.0}},
        "server_push_pull_fused_vs_mpi_allreduce": 2.031,
    }
    asked = []
    monkeypatch.setattr(rp, "cli", lambda args, timeout_s=0: asked.append(args) or json.dumps(figures))
    link, run = rp._smb_across_link(rp.Ctx(tmp_path, quick=False, root=True))
    assert asked == [["bench", "box", "--emulate-nodes", "2", "--link-gbps", "1", "--json"]]
    assert (
        link["speedup"] == 2.031
        and link["box_push_pull_ms"] == 291.0
        and run.startswith("parambox bench box")
    )
    assert rp._smb_across_link(rp.Ctx(tmp_path, quick=True, root=True)) == (
        {"skipped": "the quick form"},
        None,
    )
    assert rp._smb_across_link(rp.Ctx(tmp_path, quick=False, root=False))[0]["skipped"].startswith(
        "needs root"
    )


@pytest.mark.parametrize(
    "speedups, verdict",
    [
        ({"threads": 1.2, "allreduce": 1.8, "box-sync": 1.7, "pipeline": 1.1}, "reproduced"),
        ({"threads": 1.9, "allreduce": 1.8, "pipeline": 1.1}, "partly"),
        ({"threads": 1.9, "allreduce": 1.0, "pipeline-dp": 1.5}, "not reproduced"),
    ],
)
def test_verdict_lerat(speedups, verdict):
    assert rp.verdict_lerat({"speedups": speedups})[0] == verdict


@pytest.mark.parametrize(
    "n_peak, err, verdict", [(32, 0.1, "reproduced"), (512, 0.1, "partly"), (2, None, "not reproduced")]
)
def test_verdict_keuper(n_peak, err, verdict):
    m = {"n_peak": {"ring": n_peak}, "validation_max_rel_error": err, "link_gbps": 1.0}
    assert rp.verdict_keuper(m)[0] == verdict


def test_every_claim_has_a_source_and_an_id():
    assert len(rp.CLAIMS) == 14 and len(set(rp.claim_ids())) == 14
    assert all(c.source and c.claim for c in rp.CLAIMS)


# -- the quick forms, as a user runs them ----------------------------------------------------------


@pytest.mark.slow
def test_reproduce_quick_writes_claims_json_and_page(tmp_path):
    out = tmp_path / "repro"
    run_cli(
        "reproduce", "--out", str(out), "--quick", "--only", "neuron,grid,phases-sim,gain-sim", timeout=200
    )
    result = json.loads((out / "claims.json").read_text())
    claims = {c["id"]: c for c in result["claims"]}
    assert list(claims) == rp.claim_ids()
    for c in result["claims"]:
        assert set(c) >= {"claim", "source", "run", "measured", "verdict", "plot"}
    for cid in ("neuron", "grid"):
        assert claims[cid]["verdict"] in rp.VERDICTS, claims[cid]
        assert claims[cid]["run"].startswith("parambox sweep")
        assert (out / claims[cid]["plot"]).exists()
    for cid in ("phases-sim", "gain-sim"):  # simulated from measured one-process runs
        assert claims[cid]["verdict"] in rp.VERDICTS and claims[cid]["why"].startswith("simulated"), claims[
            cid
        ]
        assert claims[cid]["measured"]["basis"] == "simulated" and claims[cid]["measured"]["compute_ms"] > 0
    assert claims["smb"]["verdict"] == "skipped" and claims["smb"]["why"] == "not in --only"
    page = (out / "index.html").read_text()
    assert "neuron/loss_curves.png" in page and "not in --only" in page


def test_reproduce_rejects_an_unknown_claim(tmp_path):
    proc = run_cli("reproduce", "--out", str(tmp_path), "--only", "nine", check=False, timeout=60)
    assert proc.returncode == 2 and "claims are neuron" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.lock("netns")  # emulated nodes: one cluster at a time (their checks see all namespaces)
@needs_root
@pytest.mark.slow
@pytest.mark.long
def test_time_to_accuracy_quick_on_the_emulated_cluster(tmp_path):
    out = tmp_path / "tta"
    run_cli("sweep", "--study", "time-to-accuracy", "--quick", "--out", str(out), timeout=230)
    res = json.loads((out / "results.json").read_text())
    entry = res["by_gbps"]["1"]
    assert set(entry["setups"]) == {"allreduce", "weight-avg"} and res["target_accuracy"] == 0.8
    for e in entry["setups"].values():
        assert len(e["times_s"]) == 1 and e["runs"][0]["status"] == "ok"
        assert e["eval_granularity_s"] is not None
    assert {"best_setup", "best_vs_baseline"} <= set(entry)
    assert (out / "time_to_accuracy.png").exists() and (out / "table.md").exists()


# -- a workload whose metric falls: the time-to-target claim and study to a perplexity -------------

BIGRAM = ["--model", "tests.workloads.bigram:model", "--data", "text"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([*BIGRAM, "--target", "perplexity=130"], "add --only tau-h"),
        (["--only", "tau-h,neuron", "--target", "perplexity=130"], "add --only tau-h"),
        (["--only", "tau-h", *BIGRAM], "give the target in the workload's metric"),
        (["--only", "tau-h", *BIGRAM, "--target", "perplexity=0"], "a perplexity is at least 1"),
    ],
)
def test_reproduce_workload_flags_go_with_the_time_to_target_claim(tmp_path, args, message):
    proc = run_cli("reproduce", "--out", str(tmp_path / "r"), *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "workers, message",
    [("1", "--workers must be at least 2"), ("2,4", "takes one --workers"), ("two", "list of int")],
)
def test_time_to_accuracy_takes_one_worker_count(tmp_path, workers, message):
    proc = run_cli(
        "sweep", "--study", "time-to-accuracy", "--workers", workers, "--out", str(tmp_path), check=False
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.long
def test_reproduce_tau_h_quick_on_text_to_a_perplexity(tmp_path):
    """The tau-H claim's quick form on the text set (a bigram: 16 steps go from perplexity 256 to ~110):
    steps to the target are the first evaluation at or under it, and the rule is judged on perplexity."""
    out = tmp_path / "repro"
    args = [
        "reproduce",
        "--out",
        str(out),
        "--quick",
        "--only",
        "tau-h",
        *BIGRAM,
        "--target",
        "perplexity=130",
    ]
    run_cli(*args, timeout=230)
    claim = next(c for c in json.loads((out / "claims.json").read_text())["claims"] if c["id"] == "tau-h")
    m = claim["measured"]
    assert m["target"] == {"metric": "perplexity", "value": 130.0, "lower_is_better": True}
    assert m["data"] == "text" and m["target_accuracy"] is None and "test_accuracy_pct" not in m
    assert m["gradient_bytes"] == 4 * 256 * 256  # the bigram's table, not LeNet's
    for r in m["rows"]:
        run = out / "tau-h" / "runs" / f"{r['method']}-{r['tau']}"
        evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
        under = [e["step"] for e in evals if e["test_perplexity"] <= 130]
        assert r["steps_to_target"] == (under[0] if under else None)
    assert any(r["steps_to_target"] for r in m["rows"])  # the synchronous-enough setups got there
    assert claim["verdict"] in rp.VERDICTS and "final test perplexity" in claim["why"]
    assert "--target perplexity=130" in claim["run"] and "perplexity <= 130" in (out / "index.md").read_text()


@pytest.mark.slow
def test_time_to_target_study_on_loopback_to_a_perplexity(tmp_path):
    out = tmp_path / "tta"
    run_cli(
        "sweep", "--study", "time-to-accuracy", "--quick", "--gbps", "loopback", *BIGRAM, "--workers", "3",
        "--target", "perplexity=130", "--steps", "16", "--set", "eval_every=4", "--out", str(out),
        timeout=230,
    )  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    assert res["target"] == {"metric": "perplexity", "value": 130.0, "lower_is_better": True}
    assert res["workers"] == res["nodes"] == 3  # --workers N: N workers, one emulated node each at a rate
    for e in res["by_gbps"]["loopback"]["setups"].values():
        config = json.loads((Path(e["runs"][0]["run_dir"]) / "config.json").read_text())
        assert config["workers"] == 3
    for e in res["by_gbps"]["loopback"]["setups"].values():
        run = e["runs"][0]
        first = next((t for t, ppl in run["curve"] if ppl <= 130), None)
        assert run["status"] == "ok" and first is not None and e["median_s"] == first
    assert (out / "table.md").read_text().startswith("# Time to test perplexity <= 130")
