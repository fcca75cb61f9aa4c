"""``parambox sweep`` (SHM-Learn-Dist §5): the loss-area metric, divergence, winners, files, resuming."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_cli

from parambox.cli import main
from parambox.commands.sweep import parse_list
from parambox.config import build_config, parse_set
from parambox.errors import UserError
from parambox.presets import preset
from parambox.studies.curves import area_under, moving_mean
from parambox.studies.grid import judge_curve, pick_winners, plan_grid
from parambox.studies.runs import train_args

# -- the metric, on plain lists ----------------------------------------------------------------------


def test_area_is_the_trapezoid_rule():
    assert area_under([0.0, 1.0, 3.0], [2.0, 2.0, 0.0]) == pytest.approx(2.0 + 2.0)
    assert area_under([0.5], [1.0]) == 0.0


def test_moving_mean_averages_the_last_window():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize(
    "losses, status, reason",
    [
        ([2.3 * 0.9**i for i in range(40)], "ok", ""),
        ([2.3 - 0.03 * i for i in range(40)], "above_threshold", "min loss"),
        ([2.3, 1.0, math.nan, 0.5], "diverged", "non-finite"),
        ([2.3, 9.0, 12.0, 11.0, 0.1, 0.1], "diverged", "blew up"),
        ([2.3, 2.25, 2.3, 2.2, 2.28, 2.26], "above_threshold", "no progress"),
    ],
)
def test_judge_curve(losses, status, reason):
    got, why, curve = judge_curve(losses, threshold=0.5)
    assert got == status and reason in why
    if status != "diverged" or "non-finite" not in reason:
        assert curve["initial_loss"] == losses[0]


def test_winner_is_the_smallest_area_among_qualifying_runs():
    def run(name, workers, status, area):
        return {
            "name": name,
            "workers": workers,
            "status": status,
            "area": area,
            "strategy": "allreduce",
            "batch_size": 16,
            "lr": 0.1,
            "min_loss": 0.1,
            "final_test_accuracy": 0.9,
        }

    runs = [
        run("a", 1, "ok", 3.0),
        run("b", 1, "above_threshold", 1.0),
        run("c", 1, "ok", 2.0),
        run("d", 2, "diverged", 0.5),
        run("e", 2, "above_threshold", 0.7),
    ]
    winners = pick_winners(runs, [1, 2])
    assert winners["1"]["name"] == "c" and winners["2"] is None


def test_every_run_sees_the_same_samples():
    planned = plan_grid(preset("digits-sweep"), ["allreduce"], [1, 2], [16, 64], [0.1], samples=24_576)
    assert [p.config["steps"] for p in planned] == [1536, 384, 768, 192]
    assert {p.config["steps"] * p.config["workers"] * p.config["batch_size"] for p in planned} == {24_576}
    with pytest.raises(UserError, match="less than one global batch"):
        plan_grid(preset("digits-sweep"), ["allreduce"], [2], [64], [0.1], samples=100)


def test_train_args_reproduce_the_config():
    cfg = {**preset("digits-weight-avg"), "lr": 0.25, "data_path": "/tmp/x y"}
    args = train_args(cfg, Path("/tmp/run"))
    sets = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
    assert build_config(parse_set(sets)).model_dump() == build_config(cfg).model_dump()


@pytest.mark.parametrize("text, kind", [("1,0", int), ("a,b", float), ("16,16", int), (",", int)])
def test_parse_list_rejects_bad_lists(text, kind):
    with pytest.raises(UserError, match="--x"):
        parse_list(text, kind, "--x")


def test_bad_flags_exit_2(tmp_path, capsys):
    assert main(["sweep", "--workers", "1,x", "--out", str(tmp_path)]) == 2
    assert main(["sweep", "--lr", "0.1", "--set", "momentum=2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "momentum" in err


# -- the command, end to end ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sweep_writes_results_marks_divergence_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    flags = [
        "sweep",
        "--workers",
        "1",
        "--batch-size",
        "16,32",
        "--lr",
        "0.2,5.0",
        "--samples",
        "1280",
        "--model",
        "logreg",
        "--loss-threshold",
        "0.6",
        "--out",
        str(out),
    ]
    proc = run_cli(*flags)
    assert "Sweep winners" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert len(runs) == 4 and all(r["launched"] for r in runs.values())
    assert {r["samples"] for r in runs.values()} == {1280}
    for b in (16, 32):
        assert runs[f"allreduce-w1-b{b}-lr5"]["status"] == "diverged"  # logreg at lr 5 blows up
        assert runs[f"allreduce-w1-b{b}-lr0.2"]["area"] > 0
    winner = results["winners"]["1"]
    assert winner["lr"] == 0.2 and runs[winner["name"]]["status"] == "ok"
    assert winner["area"] == min(r["area"] for r in runs.values() if r["status"] == "ok")
    for name in ("heatmap_workers1.png", "areas_workers1.png", "loss_workers1.png", "table.md"):
        assert (out / name).stat().st_size > 0
    assert "| 1 | allreduce |" in (out / "table.md").read_text()

    # Interrupted sweep: one run left without summary.json. Rerunning redoes it and only it.
    mtimes = {n: (Path(r["run_dir"]) / "summary.json").stat().st_mtime_ns for n, r in runs.items()}
    unfinished = out / "runs" / "allreduce-w1-b32-lr0.2"
    (unfinished / "summary.json").unlink()
    capsys.readouterr()
    assert main(flags) == 0  # in this process: one interpreter start-up less
    assert "3 finished run(s) reused, 1 to run" in capsys.readouterr().out
    again = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert [n for n, r in again.items() if r["launched"]] == ["allreduce-w1-b32-lr0.2"]
    for n in mtimes:
        if n != "allreduce-w1-b32-lr0.2":
            assert (Path(again[n]["run_dir"]) / "summary.json").stat().st_mtime_ns == mtimes[n]
    assert (unfinished / "summary.json").exists()

    # The same --out with other settings is refused before anything runs.
    assert main([*flags[:8], "640", *flags[9:]]) == 2
    assert "holds a finished run with steps=" in capsys.readouterr().err


def test_the_loss_figure_of_a_grid_whose_every_run_failed_says_so_without_a_warning(tmp_path):
    """Every run of a worker count failed (a killed worker): the figure is still written, with a note
    and no legend (matplotlib's "No artists with labels" warning used to reach the user's screen)."""
    import warnings

    from parambox.studies.figures.grid import loss_curves

    runs = [{"status": "failed", "run_dir": str(tmp_path / "r"), "strategy": "allreduce"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = loss_curves(runs, 2, tmp_path / "loss.png")
    assert path.stat().st_size > 0
