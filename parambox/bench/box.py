"""``parambox bench box``: how fast the box moves bytes, next to gloo, MPI and the memory itself.

For S = 1, 25, 100 MiB of float32 (medians of ``repeats`` timed runs after one warm-up):

- ``numpy_add`` / ``numpy_copy``: one process, ``a += b`` and ``np.copyto(a, b)``: the physical limit.
  numpy asks the kernel for huge pages; shared memory cannot have them on a host whose
  ``transparent_hugepage/shmem_enabled`` is ``never`` (this one), so ``numpy_add_4k`` /
  ``numpy_copy_4k`` repeat them with the destination in 4 KiB pages, the limit for any shm buffer.
- ``shm_push`` / ``shm_pull``: one process pushes (``box[:n] += delta``, striped locks included) or
  pulls S bytes of a shm box while a second process has the box attached. Timed in the same
  process as the numpy figures, alternating with them, on one torch thread, as numpy uses one.
- ``rma_push`` / ``rma_pull``: under ``mpiexec -n 2``, rank 0 accumulates into (``Accumulate`` +
  ``Flush``) or gets from the window of rank 1 (``box_ranks=[1]``) while rank 1 sleeps in a
  barrier (polled every 5 ms); once on Open MPI's shared-memory one-sided component and once (``rma_tcp_*``) on the
  network path (``OMPI_MCA_osc=rdma OMPI_MCA_btl=self,tcp``).
  ``rma_pull`` is ``Get_accumulate(NO_OP)``, the atomic read (issue 13); ``rma_pull_get`` the plain
  ``Get`` it replaced (``rma_pull_noop_vs_get`` = Get time / NO_OP time). Windows carry
  ``accumulate_ordering=none``. ``rma_push_sharded``: the same push into a box sharded over both
  ranks (half of it into rank 0's own window), against which ``rma_push_memory_vs_sharded`` prices
  the memory-rank layout (the whole box on a rank that does not train).
- ``mpi_allreduce`` (and ``mpi_allreduce_tcp``): ``MPI_Allreduce`` of S bytes over the same 2 ranks.
- ``gloo_allreduce``: ``torch.distributed.all_reduce`` of S bytes, 2 processes on loopback.

``gbps`` is payload bytes (S) per second, not memory traffic. Ratios at 100 MiB: ``shm_push_vs_add``
= numpy add time / shm push time (median of the paired ratios; 1.0 means memory speed),
``shm_push_vs_add_4k`` the same against ``numpy_add_4k``, ``shm_push_vs_gloo`` = gloo allreduce /
shm push, ``rma_push_vs_gloo`` = gloo allreduce / rma push. ``host`` records the huge-page settings
and the load average, which move these figures on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch

from parambox.bench.rounds import paired_ratio
from parambox.bench.workers import exit_worker, warm
from parambox.perfmodel.compute import time_calls
from parambox.runtime import spawn
from parambox.runtime.dist import destroy_distributed

MIB = 1 << 20
MPI_ENV = {"OMPI_MCA_osc": "^ucx"}  # Open MPI's shared-memory one-sided path
MPI_TCP_ENV = {"OMPI_MCA_osc": "rdma", "OMPI_MCA_btl": "self,tcp"}  # its network path
_MARK = "BENCH_BOX_JSON "
_MODULE = "parambox.bench.box"  # children run it with -m (``__name__`` is "__main__" there)


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    return time_calls(fn, repeats, warmup=1)  # warm-up: first touch of pages, lazy set-up


def _figure(seconds: Sequence[float], size_mb: int) -> dict[str, float]:
    t = statistics.median(seconds)
    return {"ms": round(t * 1e3, 3), "gbps": round(size_mb * MIB / t / 1e9, 2)}


def _reps(repeats: int, size_mb: int) -> int:
    """Small transfers take microseconds and are noisy: repeat them more (it costs nothing)."""
    return repeats * 5 if size_mb < 10 else repeats


def _numel(size_mb: int) -> int:
    return size_mb * MIB // 4


# -- one process + shm ---------------------------------------------------------------------------------


def bench_local_and_shm(sizes_mb: Sequence[int], repeats: int) -> tuple[dict, dict]:
    """numpy add/copy and shm push/pull, alternating in this process; returns (ops, paired ratios)."""
    from parambox.box import PREFIX_ENV, open_box
    from parambox.runtime.world import World

    prefix = spawn.new_prefix()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PREFIX_ENV: prefix})
    numel = _numel(max(sizes_mb))
    cmd = [sys.executable, "-m", _MODULE, "--role", "shm-peer", "--numel", str(numel)]
    peer = spawn.start(cmd, env, stdin=subprocess.PIPE, warm=warm())  # timed: a fresh interpreter
    old_prefix, threads = os.environ.get(PREFIX_ENV), torch.get_num_threads()
    os.environ[PREFIX_ENV] = prefix
    torch.set_num_threads(1)
    ops: dict[str, dict] = {}
    ratios: dict[str, dict] = {
        "push_vs_add": {},
        "pull_vs_copy": {},
        "push_vs_add_4k": {},
        "pull_vs_copy_4k": {},
    }
    try:
        box = open_box("shm", World(0, 2, 0, 2, launcher="local"), numel, 1, "bench", timeout=60)
        for mb in sizes_mb:
            n = _numel(mb)
            pairs = _local_ops(box, n)
            times = {k: [] for k in pairs}
            for _ in range(_reps(repeats, mb)):  # alternate, so drift of the shared machine hits both alike
                for k, fn in pairs.items():
                    times[k] += _time(fn, 1)
            for k, ts in times.items():
                ops.setdefault(k, {})[str(mb)] = _figure(ts, mb)
            for suffix in ("", "_4k"):
                ratios[f"push_vs_add{suffix}"][str(mb)] = _paired(
                    times[f"numpy_add{suffix}"], times["shm_push"]
                )
                ratios[f"pull_vs_copy{suffix}"][str(mb)] = _paired(
                    times[f"numpy_copy{suffix}"], times["shm_pull"]
                )
        peer.stdin.close()  # lets the peer go
        box.close()
        peer.wait(60)
    finally:
        spawn.stop([peer])
        spawn.remove_segments(prefix)
        torch.set_num_threads(threads)
        if old_prefix is None:
            os.environ.pop(PREFIX_ENV, None)
        else:
            os.environ[PREFIX_ENV] = old_prefix
    return ops, ratios


def _local_ops(box, n: int) -> dict[str, Callable[[], object]]:
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    # The worker's tensors are allocated as the numpy operands are (numpy asks for huge pages), so
    # the ratio compares the box's accumulate with memory speed, not two allocators' page sizes.
    delta, out = torch.from_numpy(np.ones(n, np.float32)), torch.from_numpy(np.empty(n, np.float32))
    small = _small_pages(n)  # where the box lives: shared memory gets 4 KiB pages only
    return {
        "numpy_add": lambda: np.add(a, b, out=a),
        "numpy_add_4k": lambda: np.add(small, b, out=small),
        "shm_push": lambda: box.push(delta),
        "numpy_copy": lambda: np.copyto(a, b),
        "numpy_copy_4k": lambda: np.copyto(small, b),
        "shm_pull": lambda: box.pull(out),
    }


def _small_pages(n: int) -> np.ndarray:
    """n float32 in anonymous memory without the huge-page advice numpy gives its own arrays.

    Shared memory (tmpfs) gets transparent huge pages only where the host allows it
    (/sys/kernel/mm/transparent_hugepage/shmem_enabled); a 4 KiB-page array shows the limit for it.
    """
    arr = np.frombuffer(mmap.mmap(-1, n * 4), dtype=np.float32)
    arr[:] = 1.0
    return arr


def _paired(base: list[float], other: list[float]) -> float:
    return round(paired_ratio(base, other), 3)


def _shm_peer(numel: int) -> None:
    from parambox.box import open_box
    from parambox.runtime.world import World

    box = open_box("shm", World(1, 2, 1, 2, launcher="local"), numel, 1, "bench", timeout=120)
    sys.stdin.read()  # attached and asleep (not polling a barrier) until the timing process is done
    box.close()


# -- MPI and gloo, in child processes -------------------------------------------------------------------


def _marked(text: str) -> dict | None:
    """The JSON a child printed after ``_MARK``, if any."""
    for line in text.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    return None


def _role_args(sizes_mb: Sequence[int], repeats: int) -> list[str]:
    return ["--sizes", ",".join(map(str, sizes_mb)), "--repeats", str(repeats)]


def _idle_barrier(comm, pause: float = 0.005, timeout: float = 300.0) -> None:
    """A barrier that sleeps between polls, so the waiting rank leaves the CPU to the timed one."""
    req, deadline = comm.Ibarrier(), time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError("bench box: the other MPI rank never reached the barrier")
        time.sleep(pause)


def _timed_collective(barrier: Callable[[], object], op: Callable[[], object]) -> float:
    """Seconds of one collective, started together after a barrier."""
    barrier()
    t0 = time.perf_counter()
    op()
    return time.perf_counter() - t0


def bench_mpi(sizes_mb: Sequence[int], repeats: int, env_extra: dict[str, str]) -> dict:
    if spawn.find_mpiexec() is None:
        return {"error": "no mpiexec found"}
    cmd = [sys.executable, "-m", _MODULE, "--role", "mpi", *_role_args(sizes_mb, repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1") | env_extra
    proc = spawn.start_mpi(cmd, 2, env, bind=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        return {"error": "mpi ranks still running after 300 s"}
    finally:
        spawn.stop([proc])
    tail = (err or out).strip().splitlines()[-3:]
    return _marked(out) or {"error": f"exit code {proc.returncode}: {' | '.join(tail)}"}


def _mpi_worker(sizes_mb: Sequence[int], repeats: int) -> None:
    from mpi4py import MPI

    from parambox.box import open_box
    from parambox.runtime.world import World

    world, comm = World.from_env(), MPI.COMM_WORLD
    numel = _numel(max(sizes_mb))
    # The memory-rank layout (rank 1 holds the box, trains nothing), and the box sharded over both.
    box = open_box("rma", world, numel, 1, "bench", box_ranks=[1], timeout=120)
    sharded = open_box("rma", world, numel, 1, "bench-sharded", num_shards=2, timeout=120)
    names = ("rma_push", "rma_pull", "rma_pull_get", "rma_push_sharded", "mpi_allreduce")
    ops: dict[str, dict] = {name: {} for name in names}
    for mb in sizes_mb:
        n = _numel(mb)
        if world.rank == 0:
            delta, out = torch.ones(n), torch.empty(n)
            timed = {
                "rma_push": partial(box.push, delta),
                "rma_pull": partial(box.pull, out),  # Get_accumulate(NO_OP): the atomic read
                "rma_pull_get": partial(_plain_get, box, out.numpy()),  # the plain Get it replaced
                "rma_push_sharded": partial(sharded.push, delta),
            }
            for name, call in timed.items():
                ops[name][str(mb)] = _figure(_time(call, _reps(repeats, mb)), mb)
        _idle_barrier(comm)  # rank 1 sleeps here while rank 0 times: its window needs no help from it
        allreduce = partial(
            _timed_collective, comm.Barrier, partial(comm.Allreduce, MPI.IN_PLACE, np.ones(n, np.float32))
        )
        allreduce()
        ops["mpi_allreduce"][str(mb)] = _figure([allreduce() for _ in range(_reps(repeats, mb))], mb)
    sharded.close()
    box.close()
    if world.rank == 0:
        print(_MARK + json.dumps(ops), flush=True)


def _plain_get(box, out: np.ndarray) -> None:
    """A pull by ``MPI_Get`` (the rma box's read before issue 13), for the before/after figure."""
    from mpi4py import MPI

    target = box.box_ranks[0]  # a box of one shard: displacements are indices
    for lo in range(0, len(out), 1 << 26):
        hi = min(len(out), lo + (1 << 26))
        box.win.Get([out[lo:hi], MPI.FLOAT], target, target=(lo, hi - lo, MPI.FLOAT))
    box.win.Flush(target)


def bench_gloo(sizes_mb: Sequence[int], repeats: int) -> dict:
    cmd = [sys.executable, "-m", _MODULE, "--role", "gloo", *_role_args(sizes_mb, repeats)]
    procs = spawn.start_ranks(
        cmd, 2, spawn.loopback_env(threads=1), stdout=subprocess.PIPE, text=True, warm=warm()
    )
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        outs = [""]
    finally:
        spawn.stop(procs)
    return _marked(outs[0]) or {"error": f"gloo workers exited with {[p.returncode for p in procs]}"}


def _gloo_worker(sizes_mb: Sequence[int], repeats: int) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    ops: dict[str, dict] = {"gloo_allreduce": {}}
    for mb in sizes_mb:
        allreduce = partial(_timed_collective, dist.barrier, partial(dist.all_reduce, torch.ones(_numel(mb))))
        allreduce()
        ops["gloo_allreduce"][str(mb)] = _figure([allreduce() for _ in range(_reps(repeats, mb))], mb)
    destroy_distributed()
    if rank == 0:
        print(_MARK + json.dumps(ops), flush=True)


# -- the whole benchmark --------------------------------------------------------------------------------


def run_bench_box(
    json_out: bool = False,
    sizes_mb: Sequence[int] = (1, 25, 100),
    repeats: int = 7,
    rounds: int | None = None,
    steps: int | None = None,  # accepted for the bench CLI's common flags; unused here
    emulate_nodes: int | None = None,
    link_gbps: float | None = None,
    quick: bool = False,
) -> dict:
    """Run every measurement once, one after the other; returns the figures and the ratios. With
    ``emulate_nodes``: the box across an emulated link instead (``bench/box_link.py``)."""
    if emulate_nodes is not None:
        from parambox.bench.box_link import run_bench_box_link

        link = {"repeats": rounds} if rounds else {}
        return run_bench_box_link(emulate_nodes, link_gbps or 1.0, quick=quick, **link)
    if quick:
        from parambox.errors import UserError

        raise UserError("bench box has no --quick form on one node; it has one with --emulate-nodes 2")
    repeats = rounds or repeats
    sizes_mb = sorted(set(int(s) for s in sizes_mb))
    say = (lambda msg: None) if json_out else (lambda msg: print(f"bench box: {msg}", file=sys.stderr))
    t0 = time.perf_counter()
    say("numpy and shm")
    ops, paired = bench_local_and_shm(sizes_mb, repeats)
    errors: dict[str, str] = {}
    for label, runner in (
        ("gloo", lambda: bench_gloo(sizes_mb, repeats)),
        ("rma", lambda: bench_mpi(sizes_mb, repeats, MPI_ENV)),
        ("rma_tcp", lambda: bench_mpi(sizes_mb, repeats, MPI_TCP_ENV)),
    ):
        say(label)
        got = runner()
        if "error" in got:
            errors[label] = got["error"]
            continue
        for op, figures in got.items():
            ops[_tcp_name(op) if label == "rma_tcp" else op] = figures
    return _summary(sizes_mb, repeats, ops, paired, errors, time.perf_counter() - t0)


def _tcp_name(op: str) -> str:
    return "mpi_allreduce_tcp" if op == "mpi_allreduce" else op.replace("rma_", "rma_tcp_", 1)


def _summary(sizes_mb, repeats, ops, paired, errors, seconds) -> dict:
    top = str(max(sizes_mb))

    def ratio(base: str, op: str) -> float | None:
        if top not in ops.get(base, {}) or top not in ops.get(op, {}):
            return None
        return round(ops[base][top]["ms"] / ops[op][top]["ms"], 2)

    result = {
        "sizes_mb": sizes_mb,
        "repeats": repeats,
        "ops": ops,
        "shm_push_vs_add": paired["push_vs_add"][top],
        "shm_pull_vs_copy": paired["pull_vs_copy"][top],
        "shm_push_vs_add_4k": paired["push_vs_add_4k"][top],
        "shm_pull_vs_copy_4k": paired["pull_vs_copy_4k"][top],
        "shm_push_vs_gloo": ratio("gloo_allreduce", "shm_push"),
        "rma_push_vs_gloo": ratio("gloo_allreduce", "rma_push"),
        "rma_tcp_push_vs_gloo": ratio("gloo_allreduce", "rma_tcp_push"),
        "rma_push_vs_mpi_allreduce": ratio("mpi_allreduce", "rma_push"),
        # Issue 13: the atomic read against the plain Get it replaced (>= 0.85 expected), and the
        # memory rank's push (all of it remote) against the box sharded over both ranks.
        "rma_pull_noop_vs_get": ratio("rma_pull_get", "rma_pull"),
        "rma_push_memory_vs_sharded": ratio("rma_push_sharded", "rma_push"),
        "rma_tcp_pull_noop_vs_get": ratio("rma_tcp_pull_get", "rma_tcp_pull"),
        "rma_tcp_push_memory_vs_sharded": ratio("rma_tcp_push_sharded", "rma_tcp_push"),
        "paired": paired,
        "seconds": round(seconds, 1),
    }
    result["host"] = _host()
    if errors:
        result["errors"] = errors
    return result


def _host() -> dict[str, object]:
    def setting(name: str) -> str | None:
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
        except OSError:
            return None
        return text.split("[")[1].split("]")[0] if "[" in text else text.strip()

    return {
        "thp": setting("enabled"),
        "shmem_thp": setting("shmem_enabled"),
        "load_average_1m": os.getloadavg()[0],
    }


def _table(result: dict) -> str:
    sizes = [str(s) for s in result["sizes_mb"]]
    lines = [f"{'op':<20}" + "".join(f"{s + ' MiB: ms, GB/s':>26}" for s in sizes)]
    for op, figures in result["ops"].items():
        cells = [
            f"{figures[s]['ms']:>12.2f} {figures[s]['gbps']:>12.2f}" if s in figures else f"{'-':>26}"
            for s in sizes
        ]
        lines.append(f"{op:<20}" + " ".join(cells))
    ratios = [k for k in result if k.endswith(("_vs_add", "_vs_copy", "_vs_gloo", "_vs_mpi_allreduce"))]
    lines += [f"{k}: {result[k]}" for k in ratios]
    lines += [f"error {k}: {v}" for k, v in result.get("errors", {}).items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parambox.bench.box", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.add_argument("--sizes", default="1,25,100", help="comma-separated sizes in MiB")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # the child processes
    p.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.role == "shm-peer":
        _shm_peer(args.numel)
    elif args.role == "mpi":
        _mpi_worker(sizes, args.repeats)
    elif args.role == "gloo":
        _gloo_worker(sizes, args.repeats)
        exit_worker()  # gloo's threads may abort in C++ destructors at a normal exit
    else:
        result = run_bench_box(json_out=args.json, sizes_mb=sizes, repeats=args.repeats)
        print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
