"""``parambox report``: fixture run directories (written here, in the training loop's format) -> files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parambox.cli import main
from parambox.errors import UserError
from parambox.report import load_run, load_runs, summary_rows, write_report


def make_run(
    root: Path,
    name: str,
    strategy: str = "allreduce",
    workers: int = 2,
    steps: int = 30,
    phases: tuple[str, ...] = ("allreduce",),
    summary: bool = True,
) -> Path:
    """A run directory like the training loop writes: metrics.jsonl (step + eval records) and summary.json."""
    d = root / name
    d.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        comm = {ph: 0.001 * (i + 1) + 1e-5 * s for i, ph in enumerate(phases)}
        rec = {"kind": "step", "step": s, "time": 0.05 * s, "loss": 2.3 * math.exp(-s / 10), "epoch": s / 10}
        lines.append({**rec, "samples_per_s": 1000.0 * workers, "comm": comm, "staleness": 0})
        if s % 10 == 0:
            lines.append(
                {
                    "kind": "eval",
                    "step": s,
                    "time": 0.05 * s,
                    "test_loss": 2.0 / s,
                    "test_accuracy": 0.5 + s / 250,
                }
            )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if summary:
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "strategy": strategy,
                    "workers": workers,
                    "steps": steps,
                    "model": "mlp",
                    "data": "digits",
                    "batch_size": 32,
                    "lr": 0.1,
                    "final_test_accuracy": 0.8,
                    "final_test_loss": 0.0667,
                    "wall_time_s": 0.05 * steps,
                    "samples_per_s": 1000.0 * workers,
                    "lost_workers": [],
                    "config": {},
                }
            )
        )
    return d


def test_load_run_reads_records_and_means(tmp_path):
    run = load_run(make_run(tmp_path, "a", phases=("gather", "broadcast"), steps=20))
    assert run.label == "allreduce x2"
    assert len(run.steps) == 20 and len(run.evals) == 2
    assert run.comm_phases() == ["gather", "broadcast"]
    # mean of 0.001 + 1e-5 * s over s = 1..20 -> 1 ms + 0.105 ms
    assert run.mean_comm_ms()["gather"] == pytest.approx(1.105)
    assert run.mean_comm_ms()["broadcast"] == pytest.approx(2.105)
    xs, ys = run.series("test_accuracy", "step", "eval")
    assert xs == [10, 20] and ys == pytest.approx([0.54, 0.58])


def test_report_writes_figures_and_table(tmp_path):
    runs = [make_run(tmp_path, "r1"), make_run(tmp_path, "r2", "ps-sync", 4, phases=("gather", "broadcast"))]
    out = tmp_path / "report"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    for name in ("loss.png", "accuracy.png", "test_loss.png", "throughput.png", "comm.png"):
        assert (out / name).stat().st_size > 5000, name
    assert len(list(out.glob("comm_*-x*.png"))) == 2
    md = (out / "index.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 3  # header + one row per run
    assert "| allreduce x2 | allreduce | 2 | mlp | digits | 30 | 80.00 | 0.0667 | 1.5 | 2,000 |" in md
    assert "comm gather (ms/step)" in table[0] and "![Training loss](loss.png)" in md
    assert "<table>" in (out / "index.html").read_text()


def test_run_without_summary_and_truncated_line(tmp_path, capsys):
    d = make_run(tmp_path, "crashed", summary=False, phases=())
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "st')  # killed mid-write
    run = load_run(d)
    assert run.label == "crashed" and run.info("steps") == 30
    header, rows = summary_rows([run])
    assert rows[0][header.index("wall time (s)")] == "1.5"
    assert "truncated last line" in capsys.readouterr().err
    write_report([run], tmp_path / "out")
    assert not (tmp_path / "out" / "comm.png").exists()  # no phases: no communication figure


def test_duplicate_labels_get_dir_names(tmp_path):
    runs = load_runs([make_run(tmp_path, "seed0"), make_run(tmp_path, "seed1")])
    assert [r.label for r in runs] == ["allreduce x2 (seed0)", "allreduce x2 (seed1)"]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing_dir", "does not exist"),
        ("no_metrics", "metrics.jsonl: missing"),
        ("bad_line", "metrics.jsonl:2: not valid JSON"),
        ("no_time", "metrics.jsonl:1: step record needs a number 'time'"),
        ("bad_summary", "summary.json: not valid JSON"),
        ("empty", "no step or eval records"),
    ],
)
def test_bad_run_dirs_are_user_errors(tmp_path, capsys, damage, message):
    d = make_run(tmp_path, "run")
    metrics = d / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    if damage == "missing_dir":
        d = tmp_path / "nope"
    elif damage == "no_metrics":
        metrics.unlink()
    elif damage == "bad_line":
        metrics.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    elif damage == "no_time":
        metrics.write_text(json.dumps({"kind": "step", "step": 1, "loss": 1.0}) + "\n")
    elif damage == "bad_summary":
        (d / "summary.json").write_text("{")
    elif damage == "empty":
        metrics.write_text("")
    with pytest.raises(UserError, match=message):
        load_run(d)
    assert main(["report", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parambox: error:") and message.split(":")[-1].strip() in err


def test_out_must_be_a_directory(tmp_path):
    d = make_run(tmp_path, "run")
    (tmp_path / "file").write_text("x")
    assert main(["report", str(d), "--out", str(tmp_path / "file")]) == 2
