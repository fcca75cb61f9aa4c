"""``parambox bench box --emulate-nodes 2 --link-gbps G``: the box across a rate-limited link.

Two ranks under mpiexec on two emulated nodes (``runtime/cluster.py``): rank 1 holds the box (the
memory node, ``box_ranks=[1]``) and trains nothing; rank 0 pushes into it and pulls from it while
rank 1 sleeps in a barrier. Both rma forms run side by side in one job: the memory server
(``box.server``, ``box/server.py``: two-sided messages, the server adds) and MPI's windows
(``Accumulate``/``Get_accumulate`` on osc/rdma over TCP).

For each transfer of S bytes (medians of ``repeats`` after one warm-up):

- ``link_bytes_per_byte``: bytes over node 0's link (``/proc/self/net/dev`` of its ``pbnet``, L2
  frames) in the direction the payload goes (sent for a push, received for a pull), per payload byte.
  Ethernet, IP and TCP headers alone make 1514/1448 = 1.046 of it. ``link_bytes_per_byte_both_ways``
  adds the other direction (requests, acks, TCP's own acks): what a half-duplex link would carry.
- ``link_fraction`` (push, pull): payload bytes per second over the link's rate (TCP's ceiling is
  0.956 of it).

And the SMB claim across the link: ``box_push_pull`` (a push, then a pull, of S bytes: one worker's
exchange with the memory node; ``_fused``: one ``box.push_pull``, whose server sends each applied
chunk straight back, so both directions of the link carry it at once) against ``mpi_allreduce`` and
``gloo_allreduce`` of the same S bytes between the two ranks on the same link (``*_vs_*``: the
allreduce's time over the box's, above 1 when the box is faster).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from parambox.bench.workers import exit_worker, spawn_workers
from parambox.runtime.heap import keep_freed_memory

MIB = 1 << 20
FORMS = {"server": True, "windows": False}


def _timed(fn, meter, repeats: int) -> tuple[float, tuple[float, float]]:
    """(median seconds, median (sent, received) link bytes) of ``repeats`` calls after one warm-up."""
    fn()
    times, sent, received = [], [], []
    for _ in range(repeats):
        s0, r0 = meter()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        s1, r1 = meter()
        sent.append(s1 - s0)
        received.append(r1 - r0)
    return statistics.median(times), (statistics.median(sent), statistics.median(received))


def _idle_barrier(comm, timeout: float = 600.0) -> None:
    req, deadline = comm.Ibarrier(), time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError("bench box: the other rank never reached the barrier")
        time.sleep(0.005)


def _push_pull(box, delta, out, fused: bool) -> None:
    if fused:
        box.push_pull(delta, out)
    else:
        box.push(delta)
        box.pull(out)


def _box_ops(world, comm, numel: int, repeats: int, meter) -> dict:
    from parambox.box import open_box

    ops: dict[str, dict] = {}
    for form, server in FORMS.items():
        box = open_box("rma", world, numel, 1, f"link-{form}", box_ranks=[1], server=server, timeout=300)
        if world.rank == 0:
            delta, out = torch.ones(numel), torch.empty(numel)
            calls = {
                "push": partial(box.push, delta),
                "pull": partial(box.pull, out),
                "push_pull": partial(_push_pull, box, delta, out, False),
                "push_pull_fused": partial(_push_pull, box, delta, out, True),
            }
            if not server:  # MPI's windows take ~30x the server's time here: push and pull suffice
                calls = {k: v for k, v in calls.items() if k in ("push", "pull")}
            for op, call in calls.items():
                seconds, (sent, received) = _timed(call, meter, repeats)
                ops[f"{form}_{op}"] = {"s": seconds, "sent": sent, "received": received}
        _idle_barrier(comm)
        box.close()
    return ops


def _collectives(numel: int, repeats: int, meter) -> dict:
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    buf, t = np.ones(numel, np.float32), torch.ones(numel)

    def mpi() -> None:
        comm.Barrier()
        comm.Allreduce(MPI.IN_PLACE, buf)

    def gloo() -> None:
        dist.barrier()
        dist.all_reduce(t)

    out = {}
    for name, fn in (("mpi_allreduce", mpi), ("gloo_allreduce", gloo)):
        seconds, (sent, received) = _timed(fn, meter, repeats)
        out[name] = {"s": seconds, "sent": sent, "received": received}
    return out


def worker(size_mb: int, repeats: int, out: Path) -> None:
    from mpi4py import MPI

    from parambox.runtime.cluster import link_bytes
    from parambox.runtime.dist import destroy_distributed, init_distributed
    from parambox.runtime.world import World

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    init_distributed(world, 300.0)
    try:
        numel = size_mb * MIB // 4
        ops = _box_ops(world, MPI.COMM_WORLD, numel, repeats, link_bytes)
        ops.update(_collectives(numel, repeats, link_bytes))
        if world.rank == 0:
            out.write_text(json.dumps(ops))
    finally:
        destroy_distributed()


def summarize(ops: dict, size_mb: int, gbps: float) -> dict:
    """Bytes per payload byte, link fractions and the SMB ratios from rank 0's raw figures."""
    size = size_mb * MIB
    rate = gbps * 1e9 / 8
    out: dict = {"ops": {}}
    for name, f in ops.items():
        entry = {"ms": round(f["s"] * 1e3, 2)}
        moved = size * (2 if "push_pull" in name or "allreduce" in name else 1)
        if name.endswith(("_push", "_pull")):
            one_way = f["sent"] if name.endswith("_push") else f["received"]
            entry["link_bytes_per_byte"] = round(one_way / size, 4)
            entry["link_fraction"] = round(size / f["s"] / rate, 3)
        entry["link_bytes_per_byte_both_ways"] = round((f["sent"] + f["received"]) / moved, 4)
        out["ops"][name] = entry
    for form in FORMS:
        for ref in ("mpi_allreduce", "gloo_allreduce"):
            for kind in ("push_pull", "push_pull_fused"):
                key = f"{form}_{kind}"
                if key in ops and ref in ops:
                    out[f"{key}_vs_{ref}"] = round(ops[ref]["s"] / ops[key]["s"], 3)
    return out


def run_bench_box_link(
    nodes: int = 2, gbps: float = 1.0, size_mb: int = 32, repeats: int = 5, quick: bool = False
) -> dict:
    """One emulated cluster at ``gbps``; returns the JSON object."""
    from parambox.errors import UserError
    from parambox.runtime.cluster import WINDOWS_MCA, EmulatedCluster, check_environment

    if nodes != 2:
        raise UserError("bench box --emulate-nodes: 2 nodes (a pusher and the memory node)")
    if not gbps > 0:
        raise UserError(f"--link-gbps must be positive, not {gbps}")
    if quick:
        size_mb, repeats = max(1, min(size_mb, round(4 * gbps))), 1
    check_environment()
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    with EmulatedCluster(nodes, gbps) as cluster:
        ops = spawn_workers(__name__, [str(size_mb), str(repeats)], 2, cluster, mpi=True, mca=WINDOWS_MCA)
    result = {
        "nodes": nodes,
        "link_gbps": gbps,
        "size_mb": size_mb,
        "repeats": repeats,
        **summarize(ops, size_mb, gbps),
        "load_average_1m": [load0, os.getloadavg()[0]],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
        exit_worker()
