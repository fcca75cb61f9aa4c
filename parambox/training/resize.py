"""A resume at another worker count: the sample stream continues, and the global batch follows the run's
``resize`` rule.

``keep-global-batch`` (the default): the global batch stays what it was, each of the ``n`` workers takes
a slice of it (slices one sample apart where ``n`` does not divide it, each rank's loss weighted by
``slice * n / global`` so that the mean gradient is the global batch's exact mean). A synchronous run
then continues the uninterrupted run's trajectory to float tolerance. ``scale-batch``: each worker keeps
``batch_size``; the global batch becomes ``batch_size * n``.

Either way the stream goes on from the samples consumed before the resume (``last.pt``'s ``"data"``):
no sample of the epoch is seen twice or skipped.

>>> rule_batch("keep-global-batch", recorded_global=64, batch_size=32, num_ranks=3)
64
>>> rule_batch("scale-batch", recorded_global=64, batch_size=32, num_ranks=3)
96
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from parambox.data.base import GlobalBatchSampler
from parambox.errors import UserError
from parambox.training.checkpoint import Resumed


def rule_batch(rule: str, recorded_global: int, batch_size: int, num_ranks: int) -> int:
    """The global batch after a resume on ``num_ranks`` data-parallel ranks."""
    return recorded_global if rule == "keep-global-batch" else batch_size * num_ranks


def continue_stream(
    sampler: GlobalBatchSampler, cfg: Any, resumed: Resumed, ctx: Any
) -> dict[str, Any] | None:
    """Continue ``sampler``'s stream where the checkpoint left it, with the rule's global batch; set the
    strategy context's loss weight for uneven slices. The ``resize`` record for ``metrics.jsonl`` when
    the worker count or the global batch changed (None otherwise)."""
    data = resumed.data
    if data is None:  # a checkpoint from before the stream was recorded: it ran at one global batch
        workers = int(resumed.config.get("workers") or cfg.workers)
        recorded = int(resumed.config.get("batch_size") or cfg.batch_size) * workers
        data = {"offset": resumed.last_step * recorded, "global_batch": recorded, "ranks": workers}
    num_ranks = sampler.world_size  # the data-parallel ranks (the workers, but memory ranks and stages)
    old_ranks = int(data.get("ranks", num_ranks))
    global_batch = int(data["global_batch"])
    if num_ranks != old_ranks:
        global_batch = rule_batch(cfg.resize, global_batch, cfg.batch_size, num_ranks)
    check_slices(global_batch, num_ranks, cfg.grad_accum, len_data=sampler.num_samples)
    sampler.continue_at(resumed.last_step, int(data["offset"]), global_batch)
    ctx.loss_weight = sampler.loss_weight
    if num_ranks == old_ranks and global_batch == int(data["global_batch"]):
        return None
    return {
        "kind": "resize",
        "step": resumed.last_step,
        "from_workers": old_ranks,
        "to_workers": num_ranks,
        "rule": cfg.resize,
        "global_batch": global_batch,
        "from_global_batch": int(data["global_batch"]),
        "batch_size": sampler.batch_size,  # this rank's slice (rank 0's in the summary)
        "samples_before": int(data["offset"]),
    }


def check_slices(global_batch: int, num_ranks: int, grad_accum: int, len_data: int | None) -> None:
    """A ``UserError`` naming the batch when the new count cannot cut the global batch (``len_data``:
    None for a stream)."""
    if global_batch < num_ranks:
        raise UserError(
            f"resize: the global batch of {global_batch} has fewer samples than the {num_ranks} workers; "
            "resume with fewer workers, or with resize=scale-batch"
        )
    if len_data is not None and global_batch > len_data:
        raise UserError(
            f"resize: the global batch of {global_batch} is more than the {len_data} training items; "
            "resume with resize=keep-global-batch or fewer workers"
        )
    base, extra = divmod(global_batch, num_ranks)
    if grad_accum > 1 and (base % grad_accum or (extra and (base + 1) % grad_accum)):
        raise UserError(
            f"resize: the global batch of {global_batch} cut over {num_ranks} workers gives slices of "
            f"{base}{f' and {base + 1}' if extra else ''}, which grad_accum {grad_accum} does not split; "
            "resume with a worker count whose slices it splits, or with resize=scale-batch"
        )


def announce(last: Path, step: int, steps: int, resized: dict[str, Any] | None) -> None:
    """Rank 0's one line on a resume, on stdout (stderr is for what went wrong: a run that then fails
    still says so in one line there): the step it continues from, and the resize if any."""
    line = f"parambox: resuming from step {step} of {steps} ({last})"
    if resized is not None:
        line += (
            f"; {resized['from_workers']} -> {resized['to_workers']} workers, {resized['rule']}: "
            f"global batch {resized['from_global_batch']} -> {resized['global_batch']}"
        )
    print(line, file=sys.stdout, flush=True)
