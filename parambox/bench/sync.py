"""``parambox bench sync``: parambox's synchronous strategies against torch DDP and the peers, side by side.

Two worker processes x 1 thread train the ~1M-parameter benchmark CNN (batch 64 per worker, SGD
momentum 0.9) on fixed random batches. Within each round every setup runs the same number of
timed steps in the same two processes, one after the other, and the order rotates each round;
the reported ratios are medians of the per-round paired ratios, which cancels most of the drift
of a shared machine. The "ceiling" setup is two processes that never communicate: no 2-process
scheme can beat it.

The peers (``parambox.bench.peers``): ``weight-avg`` against PyTorch's ``PostLocalSGDOptimizer`` at the
same period (4), and ``diloco`` (synchronous, inner SGD as above, outer Nesterov 0.7/0.9 every 4 steps)
against torchft's ``DiLoCo`` with the same settings where torchft is importable (``parambox[peers]``);
otherwise ``ratio_diloco_vs_torchft_diloco`` is null and ``torchft_diloco_skipped`` says why.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parambox.bench.rounds import paired_ratio
from parambox.bench.workers import BATCH, close_setups, exit_worker, run_setups, spawn_workers
from parambox.runtime.dist import destroy_distributed
from parambox.runtime.heap import keep_freed_memory

SETUPS = ["ddp", "ceiling", "post-local-sgd", "torchft-diloco"]  # the steppers that are not parambox's
PERIOD = 4  # weight-avg's period, PostLocalSGD's, and diloco's inner steps (with torchft's sync_every)


def _build(seed: int = 0):
    from parambox.models import build_model

    torch.manual_seed(seed)
    model = build_model("cnn", (3, 32, 32), 10)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _make_sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _strategy_stepper(name: str, world, steps: int):
    """A step function running parambox's own strategy class, as `parambox train` would."""
    from parambox.strategies import Context, build_strategy, strategy_class
    from parambox.workload.losses import default_loss

    model, _ = _build()
    ctx = Context(world, model, _make_sgd, default_loss, steps, 300.0)
    strategy = build_strategy(name, ctx, dict.fromkeys(strategy_class(name).period_options, PERIOD))
    return strategy.step, strategy.close


def ddp_stepper():
    """torch DDP (gloo) on the benchmark CNN: the reference every synchronous setup is held against."""
    from torch.nn.parallel import DistributedDataParallel

    model, opt = _build()
    ddp = DistributedDataParallel(model)

    def step(batch, i):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    return step, lambda: None


def plain_stepper():
    """The same model and optimizer, never communicating: the ceiling no 2-process scheme can beat."""
    model, opt = _build()

    def step(batch, i):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step, lambda: None


def make_stepper(name: str, world, steps: int):
    if name == "ddp":
        return ddp_stepper()
    if name == "ceiling":
        return plain_stepper()
    if name == "post-local-sgd":
        from parambox.bench.peers import post_local_sgd_stepper

        return post_local_sgd_stepper(_build()[0], _make_sgd, PERIOD)
    if name == "torchft-diloco":
        from parambox.bench.peers import torchft_diloco_stepper

        return torchft_diloco_stepper(_build()[0], _make_sgd, PERIOD)
    return _strategy_stepper(name, world, steps)


def worker(setups: list[str], rounds: int, steps: int, warmup: int, out: Path) -> None:
    from parambox.runtime.world import World

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    dist.init_process_group("gloo", rank=world.rank, world_size=world.world_size)
    try:
        steppers = {name: make_stepper(name, world, warmup + rounds * steps) for name in setups}
        per_round = run_setups(steppers, world, rounds, steps, warmup).per_round
        close_setups(steppers)
        if world.rank == 0:
            out.write_text(json.dumps(per_round))
    finally:
        destroy_distributed()


def run_bench_sync(
    setups: list[str] | None = None, rounds: int = 5, steps: int = 30, warmup: int = 5, workers: int = 2
) -> dict:
    """Spawn the workers, collect per-round samples/s, and compute paired ratios."""
    from parambox.bench.peers import torchft_missing
    from parambox.errors import UserError
    from parambox.strategies import STRATEGIES

    missing = torchft_missing()
    default = ["ddp", "allreduce", "box-sync", "weight-avg", "post-local-sgd", "diloco", "torchft-diloco"]
    setups = setups or [s for s in [*default, "ceiling"] if not (s == "torchft-diloco" and missing)]
    unknown = [s for s in setups if s not in STRATEGIES and s not in SETUPS]
    if unknown:
        raise UserError(
            f"bench sync: unknown setups {unknown}; choose from {', '.join([*default, 'ceiling'])}"
        )
    if "torchft-diloco" in setups and missing:
        raise UserError(f"bench sync: torchft-diloco cannot run: {missing}")
    args = [",".join(setups), str(rounds), str(steps), str(warmup)]
    per_round = spawn_workers("parambox.bench.sync", args, workers)
    result = summarize(per_round, rounds, steps, workers)
    if "diloco" in per_round and "torchft-diloco" not in per_round:
        result["ratio_diloco_vs_torchft_diloco"] = None
        result["torchft_diloco_skipped"] = missing or "not among the setups"
    return result


def summarize(per_round: dict[str, list[float]], rounds: int, steps: int, workers: int) -> dict:
    result: dict = {
        "workers": workers,
        "threads_per_worker": 1,
        "batch_per_worker": BATCH,
        "model": "cnn",
        "period": PERIOD,
        "rounds": rounds,
        "steps_per_round": steps,
        "samples_per_s": {k: statistics.median(v) for k, v in per_round.items()},
        "per_round_samples_per_s": per_round,
    }

    def paired(a: str, b: str) -> float:
        return paired_ratio(per_round[a], per_round[b])

    if "allreduce" in per_round:
        result["ratio_vs_ddp"] = paired("allreduce", "ddp")
    if "box-sync" in per_round:
        result["ratio_box_sync_vs_ddp"] = paired("box-sync", "ddp")
        if "ceiling" in per_round:
            result["ratio_box_sync_vs_ceiling"] = paired("box-sync", "ceiling")
    if {"weight-avg", "post-local-sgd"} <= set(per_round):  # target >= 1.0
        result["ratio_weight_avg_vs_post_local_sgd"] = paired("weight-avg", "post-local-sgd")
    if {"diloco", "torchft-diloco"} <= set(per_round):
        result["ratio_diloco_vs_torchft_diloco"] = paired("diloco", "torchft-diloco")
    if "ceiling" in per_round and "ddp" in per_round:
        result["ratio_ddp_vs_ceiling"] = paired("ddp", "ceiling")
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(
            sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
        )
        exit_worker()  # gloo's threads may abort in C++ destructors at a normal exit
