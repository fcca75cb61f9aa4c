"""The scaling study (SHM-Learn-Dist §6): same samples per run, ps-sync's phase times, the figures."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from parambox.cli import main
from parambox.errors import UserError
from parambox.presets import preset
from parambox.studies.scaling import plan_runs


def test_plan_gives_every_run_the_same_samples():
    base = preset("scaling-study")  # batch 32
    planned = plan_runs(base, ["ps-sync", "single"], [1, 2, 4], samples=3200)
    assert [p.name for p in planned] == ["ps-sync-w1", "ps-sync-w2", "ps-sync-w4", "single-w1"]
    assert [p.config["steps"] for p in planned] == [100, 50, 25, 100]
    assert [p.config["eval_every"] for p in planned] == [10, 5, 2, 10]  # about ten evaluations each
    with pytest.raises(UserError, match="single"):
        plan_runs(base, ["single"], [2], samples=3200)


def test_bad_flags_exit_2(tmp_path, capsys):
    out = str(tmp_path / "s")
    assert main(["sweep", "--study", "scaling", "--lr", "0.1,0.2", "--out", out]) == 2
    assert main(["sweep", "--study", "scaling", "--target-accuracy", "90", "--out", out]) == 2
    assert main(["sweep", "--study", "scaling", "--strategy", "nope", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--lr" in err and "--target-accuracy" in err and "nope" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scaling_study_on_one_and_two_workers(tmp_path):
    out = tmp_path / "scaling"
    proc = run_cli(
        "sweep",
        "--study",
        "scaling",
        "--workers",
        "1,2",
        "--samples",
        "1280",
        "--model",
        "logreg",
        "--target-accuracy",
        "0.5",
        "--out",
        str(out),
    )
    assert "scaling study" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert set(runs) == {"ps-sync-w1", "ps-sync-w2"} and all(r["status"] == "ok" for r in runs.values())
    assert runs["ps-sync-w1"]["steps"] == 2 * runs["ps-sync-w2"]["steps"] == 40
    # Figs. 6.4-6.6: the parameter server's three phases, timed at every worker count.
    for r in runs.values():
        assert set(r["comm_ms_per_step"]) == {"gather", "average", "broadcast"}
        assert all(v >= 0 for v in r["comm_ms_per_step"].values())
    assert runs["ps-sync-w2"]["comm_ms_per_step"]["gather"] > 0
    assert runs["ps-sync-w1"]["time_to_accuracy_s"] is not None  # logreg passes 50 % on digits quickly
    for name in ("loss_ps-sync.png", "accuracy_ps-sync.png", "comm_phases.png", "time_to_accuracy.png"):
        assert (out / name).stat().st_size > 0
    table = (out / "table.md").read_text()
    assert "gather (ms/step)" in table and "| ps-sync | 2 |" in table
