"""Tier (b): synchronous data parallelism over 2 workers at batch b equals one process at batch 2b."""

from __future__ import annotations

import pytest

from tests.conftest import MPI_ENV, NUMERICS, final_weights, max_abs_diff, run_cli

COMMON = NUMERICS


@pytest.fixture
def single_2b(single_b32):
    return single_b32


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy", ["allreduce", *(pytest.param(s, marks=pytest.mark.slow) for s in ("ps-sync", "weight-avg"))]
)
def test_two_workers_match_single_at_double_batch(strategy, single_2b, tmp_path):
    out = tmp_path / "run"
    run_cli(
        "train", "--strategy", strategy, "--workers", "2", "--batch-size", "16", "--out", str(out), *COMMON
    )
    assert max_abs_diff(final_weights(out), single_2b) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_allreduce_with_momentum_and_small_buckets_matches_single(tmp_path):
    """Many buckets (one per parameter) and momentum: still the single-process trajectory."""
    args = [*COMMON, "--momentum", "0.9"]  # the later flag wins
    run_cli(
        "train",
        "--strategy",
        "single",
        "--workers",
        "1",
        "--batch-size",
        "32",
        "--out",
        str(tmp_path / "a"),
        *args,
    )
    run_cli(
        "train",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch-size",
        "16",
        "--out",
        str(tmp_path / "b"),
        "--set",
        "allreduce.bucket_mb=0.001",
        "--set",
        "allreduce.first_bucket_mb=0.001",
        *args,
    )
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "box,zero_copy,bucket_mb", [("shm", "true", 1), ("shm", "false", 1), ("rma", "false", 0.004)]
)
def test_box_sync_matches_single_at_double_batch(box, zero_copy, bucket_mb, tmp_path, single_2b):
    """On the rma box (its memory server, as across nodes), buckets of 1,048 floats go into the box
    during backward (early pushes), and each block's gated pull is asked as soon as it is pushed."""
    out = tmp_path / "run"
    run_cli(
        "train",
        "--strategy",
        "box-sync",
        "--box",
        box,
        "--workers",
        "2",
        "--batch-size",
        "16",
        "--out",
        str(out),
        "--set",
        f"box-sync.zero_copy={zero_copy}",
        "--set",
        f"box-sync.bucket_mb={bucket_mb}",
        *(["--set", "box.server=true"] if box == "rma" else []),
        *COMMON,
        env=MPI_ENV,
    )
    assert max_abs_diff(final_weights(out), single_2b) <= 1e-5
