"""``parambox bench async``: parambox's asynchronous strategies against a plain PyTorch Hogwild loop.

Two worker processes x 1 thread train the ~1M-parameter benchmark CNN of ``bench sync`` (3x32x32
input, 10 classes, batch 64 per worker, SGD lr 0.01 momentum 0.9) on fixed random batches. The
setups:

- ``plain``: Hogwild written the way pytorch/examples ``mnist_hogwild`` writes it: the model's
  ``share_memory()``, and each process steps its own optimizer on the shared parameters
  (``zero_grad``, forward, ``backward``, ``step``). The example forks its processes and hands them
  the model; these are started with ``subprocess`` (no pickle between processes), so rank 0 calls
  ``model.share_memory()`` exactly as the example does and rank 1 maps the very same storages:
  ``share_memory()`` leaves each storage in a POSIX shared-memory file held open by rank 0, whose
  descriptor rank 1 opens through ``/proc/<pid>/fd/<fd>`` (``UntypedStorage.from_file(shared=True)``).
- ``hogwild``, ``easgd-tau1``, ``easgd-tau4``, ``downpour`` (``n_push`` 1), ``dogwild``: parambox's own
  strategy classes, built through ``build_strategy(name, ctx, options)`` as ``parambox train`` builds
  them, over the ``shm`` box (dogwild over gloo messages: rank 0 is the master and trains too). A
  strategy that is not in this build is left out. ``ratio_dogwild_vs_hogwild`` (target 0.8): what
  the messages (weights broadcast to every worker, gradients to the master) cost against shared memory.

Every setup runs in the same two processes; within a round each runs the same number of timed
steps between two barriers, one after the other, the order rotating each round. The ratios are
medians of the per-round paired ratios, which cancels most of the drift of a shared machine.

Where ``mpiexec`` is found, the price of the rma box's memory rank (issue 13): ``easgd`` tau 4 over
the rma box, two workers, with the box on a third rank that trains nothing (``easgd-rma-memory``,
the fault-tolerant layout) and sharded over the two workers (``easgd-rma-sharded``); one MPI job
per layout and round, alternating, each worker timing its own steps after a warm-up.
``ratio_rma_memory_vs_sharded`` is the median of the paired ratios of their samples/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parambox.bench.rounds import paired_ratio
from parambox.bench.workers import BATCH, close_setups, exit_worker, random_batches, run_setups, spawn_workers
from parambox.errors import RunFailed
from parambox.numerics import is_finite
from parambox.runtime import scratch, spawn
from parambox.runtime.dist import destroy_distributed
from parambox.runtime.heap import keep_freed_memory
from parambox.runtime.spawn import find_mpiexec

LR, MOMENTUM = 0.01, 0.9
STRATEGY_SETUPS = {  # setup -> (strategy, options)
    "hogwild": ("hogwild", {}),
    "easgd-tau1": ("easgd", {"tau": 1}),
    "easgd-tau4": ("easgd", {"tau": 4}),
    "downpour": ("downpour", {"n_push": 1, "n_fetch": 1}),
    "dogwild": ("dogwild", {}),
}
RATIOS = {  # key -> (numerator, denominator, target or None)
    "ratio_hogwild_vs_plain": ("hogwild", "plain", 1.0),
    "ratio_easgd_tau4_vs_hogwild": ("easgd-tau4", "hogwild", 0.95),
    "ratio_easgd_tau1_vs_hogwild": ("easgd-tau1", "hogwild", 0.95),
    "ratio_downpour_vs_hogwild": ("downpour", "hogwild", None),
    "ratio_dogwild_vs_hogwild": ("dogwild", "hogwild", 0.8),
    "ratio_rma_memory_vs_sharded": ("easgd-rma-memory", "easgd-rma-sharded", None),
}
PLAIN_SHARING = (
    "rank 0: model.share_memory(); rank 1 maps the same storages through /proc/<pid>/fd/<fd> "
    "(subprocess workers, no fork, no pickle)"
)


def _make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _build():
    from parambox.models import build_model

    torch.manual_seed(0)
    return build_model("cnn", (3, 32, 32), 10)


def _plain_stepper(world, tmp: Path):
    """The pytorch/examples mnist_hogwild loop on a model shared as ``model.share_memory()`` shares it."""
    model = _build()
    handles = tmp / "plain_storages.json"
    if world.rank == 0:
        model.share_memory()
        fds = [p.untyped_storage()._share_fd_cpu_() for p in model.parameters()]
        handles.write_text(json.dumps([[os.getpid(), fd, size] for fd, size in fds]))
    dist.barrier()
    if world.rank != 0:
        for p, (pid, fd, size) in zip(model.parameters(), json.loads(handles.read_text())):
            storage = torch.UntypedStorage.from_file(f"/proc/{pid}/fd/{fd}", shared=True, nbytes=size)
            p.data = torch.empty(0).set_(storage, p.storage_offset(), p.shape, p.stride())
    dist.barrier()  # rank 0 keeps its descriptors open; both now step the same memory
    optimizer = _make_optimizer(model.parameters())

    def step(batch, i):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step, lambda: None, model


def _strategy_stepper(setup: str, world, steps: int):
    from parambox.strategies import Context, build_strategy
    from parambox.workload.losses import default_loss

    name, options = STRATEGY_SETUPS[setup]
    ctx = Context(world, _build(), _make_optimizer, default_loss, steps, 300.0)
    strategy = build_strategy(name, ctx, options)

    def close() -> None:  # the protocol's end (dogwild's threads and final weights), then release
        strategy.finish()
        strategy.close()

    return (lambda batch, i: strategy.step(batch, i).loss), close, None


def available_setups() -> list[str]:
    from parambox.strategies import STRATEGIES

    return ["plain", *(s for s, (name, _) in STRATEGY_SETUPS.items() if name in STRATEGIES)]


def worker(setups: list[str], rounds: int, steps: int, warmup: int, out: Path) -> None:
    from parambox.runtime.world import World

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    dist.init_process_group("gloo", rank=world.rank, world_size=world.world_size)
    try:
        total = warmup + rounds * steps
        steppers = {
            s: _plain_stepper(world, out.parent) if s == "plain" else _strategy_stepper(s, world, total)
            for s in setups
        }
        measured = run_setups(steppers, world, rounds, steps, warmup)
        per_round, losses = measured.per_round, measured.outputs
        shared = {s: _same_on_both_ranks(steppers[s][2]) for s in setups if steppers[s][2] is not None}
        close_setups(steppers)
        nonfinite = [s for s, v in losses.items() if not is_finite(v)]
        if world.rank == 0:
            out.write_text(json.dumps({"per_round": per_round, "nonfinite": nonfinite, "shared": shared}))
    finally:
        destroy_distributed()


def _same_on_both_ranks(model) -> bool:
    """After both processes stepped it, a shared model holds the same weights in both."""
    mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    both = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(both, mine)
    return all(torch.equal(both[0], t) for t in both)


def run_bench_async(
    rounds: int = 7, steps: int = 30, warmup: int = 5, setups: list[str] | None = None, rma: bool = True
) -> dict:
    """Spawn the two workers, collect per-round samples/s, and compute paired ratios."""
    setups = setups or available_setups()
    args = [",".join(setups), str(rounds), str(steps), str(warmup)]
    data = spawn_workers("parambox.bench.asynchronous", args, workers=2)
    per_round = data["per_round"]
    if rma and find_mpiexec() is not None:
        per_round.update(rma_rounds(rounds, steps, warmup))
    result = summarize(per_round, data["nonfinite"], rounds, steps)
    result["plain_weights_shared"] = data["shared"].get("plain")
    return result


RMA_LAYOUTS = {"easgd-rma-memory": 1, "easgd-rma-sharded": 0}  # setup -> memory ranks


def rma_rounds(rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per-round samples/s of easgd over the rma box, memory rank against sharded (one job each)."""
    per_round: dict[str, list[float]] = {s: [] for s in RMA_LAYOUTS}
    for r in range(rounds):
        order = list(RMA_LAYOUTS) if r % 2 == 0 else list(reversed(RMA_LAYOUTS))
        for setup in order:
            per_round[setup].append(_rma_job(RMA_LAYOUTS[setup], steps, warmup))
    return per_round


def _rma_job(memory_ranks: int, steps: int, warmup: int) -> float:
    with scratch.folder(scratch.BENCH) as tmp:
        cmd = [sys.executable, "-m", "parambox.bench.asynchronous", "--rma-worker"]
        cmd += [str(memory_ranks), str(steps), str(warmup), tmp]
        env = dict(os.environ, OMP_NUM_THREADS="1", PARAMBOX_SHM_PREFIX=spawn.new_prefix())
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        proc = spawn.start_mpi(cmd, 2 + memory_ranks, env, fault_tolerant=True, **pipes)
        try:
            _, err = proc.communicate(timeout=600)
        finally:
            spawn.stop([proc])
        rates = [json.loads(f.read_text()) for f in Path(tmp).glob("rate*.json")]
        if proc.returncode != 0 or len(rates) != 2:
            tail = " | ".join((err or "").strip().splitlines()[-3:])
            raise RunFailed(f"bench async: the rma job (memory ranks {memory_ranks}) failed: {tail}")
        return float(sum(rates))


def rma_worker(memory_ranks: int, steps: int, warmup: int, out: Path) -> None:
    import time

    from parambox.box import BoxConfig
    from parambox.runtime.world import World
    from parambox.strategies import Context, build_strategy
    from parambox.workload.losses import default_loss

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    box = BoxConfig(backend="rma", memory_ranks=memory_ranks)
    ctx = Context(world, _build(), _make_optimizer, default_loss, warmup + steps, 300.0, box=box)
    strategy = build_strategy("easgd", ctx, {"tau": 4})
    batches = random_batches(world.rank)
    if not strategy.serves:
        for i in range(warmup + steps):
            if i == warmup:
                t0 = time.perf_counter()
            strategy.step(batches[i % len(batches)], i)
        (out / f"rate{world.rank}.json").write_text(json.dumps(steps * BATCH / (time.perf_counter() - t0)))
    strategy.finish()
    strategy.close()


def summarize(per_round: dict[str, list[float]], nonfinite: list[str], rounds: int, steps: int) -> dict:
    result: dict = {
        "workers": 2,
        "threads_per_worker": 1,
        "batch_per_worker": BATCH,
        "model": "cnn",
        "optimizer": f"sgd lr {LR} momentum {MOMENTUM}",
        "rounds": rounds,
        "steps_per_round": steps,
        "plain_hogwild_sharing": PLAIN_SHARING,
        "samples_per_s": {k: statistics.median(v) for k, v in per_round.items()},
        "nonfinite_setups": nonfinite,
    }
    targets = {}
    for key, (a, b, target) in RATIOS.items():
        if a in per_round and b in per_round:
            result[key] = paired_ratio(per_round[a], per_round[b])
            if target is not None:
                targets[key] = {"target": target, "met": result[key] >= target}
    result["targets"] = targets
    result["per_round_samples_per_s"] = per_round
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--rma-worker":
        rma_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
        exit_worker()
    elif sys.argv[1] == "--worker":
        worker(
            sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
        )
        exit_worker()  # gloo's threads may abort in C++ destructors at a normal exit
