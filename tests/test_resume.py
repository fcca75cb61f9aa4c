"""Tier (c): a run SIGKILLed after a checkpoint and resumed ends with the uninterrupted run's weights."""

from __future__ import annotations

import pytest

from tests.conftest import final_weights, max_abs_diff, run_cli, summary

ARGS = [
    "--model",
    "mlp",
    "--steps",
    "40",
    "--checkpoint-every",
    "10",
    "--eval-every",
    "0",
    "--no-progress",
    "--threads",
    "1",
    "--batch-size",
    "16",
]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["allreduce", "weight-avg"])
def test_sigkill_then_resume_matches_uninterrupted(strategy, tmp_path):
    extra = ["--set", "weight-avg.period=3"] if strategy == "weight-avg" else []
    run_cli("train", "--strategy", strategy, "--out", str(tmp_path / "full"), *ARGS, *extra)
    killed = run_cli(
        "train",
        "--strategy",
        strategy,
        "--out",
        str(tmp_path / "cut"),
        *ARGS,
        *extra,
        env={"PARAMBOX_FAULT": "1:25:kill"},
        check=False,
    )
    assert killed.returncode != 0
    assert "worker rank 1 failed: killed by signal SIGKILL" in killed.stderr
    assert not (tmp_path / "cut" / "summary.json").exists()
    run_cli("train", "--strategy", strategy, "--out", str(tmp_path / "cut"), "--resume", *ARGS, *extra)
    assert summary(tmp_path / "cut")["steps"] == 40
    assert max_abs_diff(final_weights(tmp_path / "cut"), final_weights(tmp_path / "full")) == 0.0
