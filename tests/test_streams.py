"""A user's ``IterableDataset`` as the training stream: the global batch at step t is the same span of
the stream whatever the number of workers, a resume (at any size) continues it, and a run reads it
with a background process. Tier (a) on the source, tier (c) through the CLI."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, default_collate

from parambox.data.base import GlobalBatchSampler
from parambox.errors import UserError
from parambox.workload.loader import StreamSource
from tests.conftest import final_weights, max_abs_diff, run_cli, summary
from tests.stream_data import N, Numbers


def _source(batch: int, rank: int, ranks: int, loaders: int = 0) -> StreamSource:
    sampler = GlobalBatchSampler(None, batch, rank, ranks, seed=0)
    return StreamSource(Numbers(), sampler, default_collate, "numbers", loaders)


def _ids(source: StreamSource, steps: range) -> list[list[int]]:
    try:
        return [source.batch(step)[0].tolist() for step in steps]
    finally:
        source.close()


@pytest.mark.parametrize("loaders", [0, 1])
def test_the_global_batch_is_the_same_span_of_the_stream_at_any_worker_count(loaders):
    """Step t's global batch is items t*G .. t*G+G-1 of the passes end to end (G = 96; a pass is 500
    items), each rank taking its slice, read here or by a background process: 1, 2 and 3 workers at
    the same global batch see the same items; a source started at step 7 (a resume) reads step 7's."""
    one = _ids(_source(96, 0, 1, loaders), range(12))
    assert one == [[(t * 96 + j) % N for j in range(96)] for t in range(12)]
    for ranks in (2, 3):
        slices = [_ids(_source(96 // ranks, r, ranks, loaders), range(12)) for r in range(ranks)]
        assert [sum((s[t] for s in slices), []) for t in range(12)] == one
    assert _ids(_source(96, 0, 1, loaders), range(7, 9)) == one[7:9]


def test_a_stream_resumed_at_another_size_continues_where_it_stopped():
    """Three steps at 2 workers x 10, then 3 workers from step 3 at a global batch of 30
    (``continue_at``, as a resume at another size does): no item skipped or seen twice."""
    before = sum((_ids(_source(10, r, 2), range(3)) for r in range(2)), [])
    after = []
    for r in range(3):
        source = _source(10, r, 3)
        source.sampler.continue_at(3, 60, 30, 3)
        after += _ids(source, range(3, 5))
    assert sorted(sum(before + after, [])) == list(range(120))


class _Empty(IterableDataset):
    def __iter__(self):
        return iter(())


class _Once(IterableDataset):
    """A stream over a generator made once: its second pass is empty."""

    def __init__(self):
        self.items = iter([torch.zeros(2)] * 6)

    def __iter__(self):
        return self.items


class _Broken(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2)
        raise OSError("disk gone")


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (_Empty, "the training stream yields no items$"),
        (_Once, "the training stream yields no items on its next pass: its __iter__ must start it again"),
        (_Broken, r"reading item 1 of the stream raised OSError: disk gone"),
    ],
)
@pytest.mark.parametrize("loaders", [0, 1])
def test_a_stream_that_yields_nothing_or_fails_is_one_line(stream, message, loaders):
    """Read here or by a background process (whose error arrives as a DataLoader's traceback): one line."""
    source = StreamSource(
        stream(), GlobalBatchSampler(None, 4, 0, 1, 0), default_collate, "make_data", loaders
    )
    try:
        with pytest.raises(UserError, match=rf"^data make_data: {message}"):
            source.batch(0)
            source.batch(1)  # (a second pass)
    finally:
        source.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stream_trained_by_two_workers_then_resumed_at_three_is_the_uninterrupted_run(tmp_path):
    """``--data tests/stream_data.py:make_data`` (an IterableDataset, and a test stream): allreduce at 2
    workers for 60 steps, then ``--resume --workers 3`` to 120, ends at the uninterrupted 120-step run's
    weights (float tolerance: another summation order), and the model learnt (test loss)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["--data", "tests/stream_data.py:make_data", "--model", "tests/stream_data.py:make_model"]
    args += ["--loss", "tests/stream_data.py:mse", "--batch-size", "16", "--lr", "0.1", "--no-progress"]
    args += ["--threads", "1", "--checkpoint-interval-s", "0", "--eval-every", "0"]
    run_cli("train", "--workers", "2", "--steps", "120", "--out", str(full), *args)
    run_cli("train", "--workers", "2", "--steps", "60", "--out", str(cut), *args)
    run_cli("train", "--out", str(cut), "--resume", "--workers", "3", "--steps", "120", *args)
    assert max_abs_diff(final_weights(cut), final_weights(full)) < 1e-5
    assert (
        summary(cut)["final_test_loss"] < 0.5 * summary(cut)["initial_test_loss"]
        if "initial_test_loss" in summary(cut)
        else summary(cut)["final_test_loss"] < 0.1
    )


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_worker_that_joins_mid_stream_reads_its_slice_of_the_same_global_batches(tmp_path):
    """``--workers 2:3`` (allreduce, in place): rank 2 joins a few steps in and the stream is cut again
    over three; with the global batch kept (36), the run equals the one that had 3 workers from the
    start (float tolerance: the slices' summation order)."""
    args = ["--data", "tests/stream_data.py:make_data", "--loss", "tests/stream_data.py:mse", "--steps", "60"]
    args += ["--batch-size", "12", "--lr", "0.05", "--no-progress", "--threads", "1", "--eval-every", "0"]
    joined, fixed = tmp_path / "joined", tmp_path / "fixed"
    run_cli(
        "train", *args, "--workers", "2:3", "--set", "on_failure=shrink", "--timeout", "20", "--out", str(joined),
        "--model", "tests/stream_data.py:make_model_late_on_rank_2", env={"PARAMBOX_FAULT": "0:0:slow"},
    )  # fmt: skip
    run_cli(
        "train", *args, "--workers", "3", "--model", "tests/stream_data.py:make_model", "--out", str(fixed)
    )
    resized = [line for line in (joined / "metrics.jsonl").read_text().splitlines() if '"resize"' in line]
    assert len(resized) == 1 and '"global_batch": 36' in resized[0], resized
    assert max_abs_diff(final_weights(joined), final_weights(fixed)) < 1e-5
