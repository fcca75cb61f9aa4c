"""``parambox bench optimizer``: ``DistributedOptimizer(strategy="allreduce")`` in a user's own loop
against torch DDP, side by side (target: at least DDP's samples/s).

The setting of ``bench sync`` (its models, batches and steppers): two worker processes x 1 thread
train the ~1M-parameter benchmark CNN (batch 64 per worker, SGD momentum 0.9) on fixed random
batches, in alternating rounds (``bench.rounds``). Both setups are the same user loop, written the
way each library asks: DDP wraps the model, the other wraps the optimizer; the process group is
the script's own. ``ceiling`` is two processes that never communicate.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch.distributed as dist
import torch.nn.functional as F

from parambox.bench.rounds import paired_ratio
from parambox.bench.sync import _build, ddp_stepper, plain_stepper
from parambox.bench.workers import BATCH, close_setups, exit_worker, run_setups, spawn_workers
from parambox.runtime.dist import destroy_distributed
from parambox.runtime.heap import keep_freed_memory

SETUPS = {"ddp": ddp_stepper, "ceiling": plain_stepper}


def _optimizer_stepper():
    from parambox.optim import DistributedOptimizer

    model, opt = _build()
    dopt = DistributedOptimizer(model, opt, strategy="allreduce")

    def step(batch, i):
        x, y = batch
        dopt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dopt.step()

    return step, dopt.close


def worker(setups: list[str], rounds: int, steps: int, warmup: int, out: Path) -> None:
    import torch

    from parambox.runtime.world import World

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    dist.init_process_group("gloo", rank=world.rank, world_size=world.world_size)
    try:
        makers = {**SETUPS, "optimizer": _optimizer_stepper}
        steppers = {name: makers[name]() for name in setups}
        per_round = run_setups(steppers, world, rounds, steps, warmup).per_round
        close_setups(steppers)
        if world.rank == 0:
            out.write_text(json.dumps(per_round))
    finally:
        destroy_distributed()


def run_bench_optimizer(rounds: int = 5, steps: int = 30, warmup: int = 5, workers: int = 2) -> dict:
    """Spawn the workers, collect per-round samples/s; ``ratio_vs_ddp`` is the target (>= 1)."""
    setups = ["ddp", "optimizer", "ceiling"]
    per_round = spawn_workers(
        "parambox.bench.optimizer", [",".join(setups), str(rounds), str(steps), str(warmup)], workers
    )
    return {
        "workers": workers,
        "threads_per_worker": 1,
        "batch_per_worker": BATCH,
        "model": "cnn",
        "rounds": rounds,
        "steps_per_round": steps,
        "samples_per_s": {k: statistics.median(v) for k, v in per_round.items()},
        "per_round_samples_per_s": per_round,
        "ratio_vs_ddp": paired_ratio(per_round["optimizer"], per_round["ddp"]),
        "ratio_ddp_vs_ceiling": paired_ratio(per_round["ddp"], per_round["ceiling"]),
        "target": "ratio_vs_ddp >= 1",
    }


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(
            sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
        )
        exit_worker()  # gloo's threads may abort in C++ destructors at a normal exit
