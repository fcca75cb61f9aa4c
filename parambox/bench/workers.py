"""What the side-by-side benchmarks share: spawning their worker processes on loopback and the
fixed random batches they train on. Workers get their arguments on the command line and hand
their figures back as JSON in a file: no pickle crosses the processes."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parambox.errors import RunFailed
from parambox.runtime import scratch, spawn
from parambox.runtime.mpi import exit_now

if TYPE_CHECKING:
    from parambox.bench.rounds import Rounds
    from parambox.runtime.cluster import EmulatedCluster
    from parambox.runtime.world import World

BATCH = 64


def random_batches(rank: int, count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed 32x32x3 batches, different per rank, so data loading costs every setup the same (nothing)."""
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(count)
    ]


def run_setups(
    steppers: Mapping[str, tuple], world: World, rounds: int, steps: int, warmup: int, meter=None
) -> Rounds:
    """The timed rounds (``bench.rounds``) of every setup, ``steppers``: name -> (step, close, ...), on this
    rank's random batches, all ranks released together by the default process group's barrier."""
    import torch.distributed as dist

    from parambox.bench.rounds import run_rounds

    step_of = {name: setup[0] for name, setup in steppers.items()}
    batches = random_batches(world.rank)
    return run_rounds(step_of, batches, rounds, steps, warmup, world.world_size * BATCH, dist.barrier, meter)


def close_setups(steppers: Mapping[str, tuple]) -> None:
    for setup in steppers.values():
        setup[1]()


def exit_worker() -> None:
    """End a benchmark worker as the training workers end (``os._exit`` once all is written)."""
    exit_now(0)


# Benchmarks time fresh interpreters, as a user's run starts them. "1": fork them warm from the zygote
# instead (runtime/zygote.py), for the test suite's smoke runs of the benchmarks, which check keys, not speed.
WARM_ENV = "PARAMBOX_BENCH_WARM"


def warm() -> bool:
    return os.environ.get(WARM_ENV) == "1"


# A limit on a benchmark's whole run, in seconds (unset: none). The test suite sets it for the smoke
# runs: a worker still running then gets SIGABRT, whose handler (``PYTHONFAULTHANDLER``, set for the
# workers where there is a limit) prints every thread's stack before the process ends, and the
# benchmark fails naming the hang, instead of the test's timeout showing only the parent waiting.
DEADLINE_ENV = "PARAMBOX_BENCH_DEADLINE_S"


def wait_all(procs: list, grace_s: float = 30.0, deadline_s: float | None = None) -> list[int]:
    """Every worker's exit code. Once one has failed, the others get ``grace_s`` to end on their own
    (they may be waiting on it in a collective, whose timeout is long) and are then stopped. Past
    ``deadline_s`` the workers still running are aborted (SIGABRT: their stacks on stderr)."""
    failed_at, start = None, time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            hung = [i for i, c in enumerate(codes) if c is None]
            for i in hung:
                procs[i].send_signal(signal.SIGABRT)
            time.sleep(2.0)  # for the stacks to be written
            spawn.stop(procs)
            raise RunFailed(f"workers {hung} still running after {deadline_s:g} s: their stacks are above")
        if failed_at is None and any(codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            spawn.stop(procs)
            return [p.wait() for p in procs]
        time.sleep(0.05)


def spawn_workers(
    module: str,
    args: list[str],
    workers: int = 2,
    cluster: EmulatedCluster | None = None,
    mpi: bool = False,
    mca: dict[str, str] | None = None,
) -> Any:
    """Run ``python -m module --worker ARGS... OUT`` as ``workers`` ranks with 1 thread each and
    return what rank 0 wrote to OUT. Shared-memory segments get an unguessable per-run prefix and
    are removed at the end, whatever happens. ``cluster``: on the nodes of a running emulated
    cluster, consecutive ranks per node; ``mpi``: under mpiexec (inside the cluster if there is one),
    with Open MPI's ``mca`` parameters there."""
    prefix = spawn.new_prefix()
    with scratch.folder(scratch.BENCH) as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, "--worker", *args, str(out)]
        env = spawn.loopback_env(threads=1, prefix=prefix)
        deadline = os.environ.get(DEADLINE_ENV)
        if deadline:
            env["PYTHONFAULTHANDLER"] = "1"
        if mpi:
            launch = functools.partial(cluster.mpi_launch, mca=mca) if cluster else None
            procs = [spawn.start_mpi(cmd, workers, env, mpi_command=launch)]
        else:
            procs = spawn.start_ranks(
                cmd, workers, env, placement=cluster and cluster.placement(workers), warm=warm()
            )  # timed: fresh interpreters (WARM_ENV)
        try:
            codes = wait_all(procs, deadline_s=float(deadline) if deadline else None)
        finally:
            spawn.stop(procs)
            spawn.remove_segments(prefix)
        if any(codes):
            raise RunFailed(f"{module} workers exited with {codes}")
        return json.loads(out.read_text())
