"""The quorum's outer step over the rma box's memory servers, under mpiexec (as tests/test_outer_step.py
does for Delayed Nesterov): two ranks, each holding half of the box (every arrival meets a local shard
and a remote one, in more than one message), quorum 2, four arrivals each weighted by their samples, in
whatever order the ticket lock gives them. The step applied by the servers (fused) and by the workers
with box operations both equal the closed form rebuilt in ticket order; the pending step's state goes
out and back (a checkpoint). Run as a script this file is the worker.
"""

from __future__ import annotations

import json

import pytest

NUMEL = 300_007
ARRIVALS = 4
LR, BETA, Q = 0.7, 0.9, 2


def pseudo_gradient(rank: int, i: int):
    import torch

    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + i))


def samples(rank: int, i: int) -> int:
    return 32 * (rank + 1) + 8 * i


def worker() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's tests
    import torch
    from mpi4py import MPI

    from parambox.box import open_box
    from parambox.runtime.world import World
    from parambox.strategies.delayed_nesterov import QUORUM_COUNTERS, QuorumNesterov, TicketLock
    from tests.test_quorum import quorum_reference

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    world = World(rank, size, rank, size, 0, 1, "mpi")
    theta0 = torch.linspace(-1, 1, NUMEL)
    out: dict = {"rank": rank}
    for fused in (True, False):
        box = open_box(
            "rma", world, 3 * NUMEL, 2 + QUORUM_COUNTERS + size, f"q{int(fused)}", server=True, timeout=30.0
        )
        if not fused:  # the worker-side step on the same box, for comparison
            box.fuses_outer_step = False
        if rank == 0:
            box.write(theta0)
        box.barrier()
        q = QuorumNesterov(box, NUMEL, NUMEL, 2 * NUMEL, TicketLock(box, 0), 2, LR, BETA, Q, rank)
        got = torch.empty(NUMEL)
        arrivals = []
        for i in range(ARRIVALS):
            closed = q.apply_(
                pseudo_gradient(rank, i),
                lambda u, s, box=box, got=got: box.push_pull(u, got, s),
                lambda g, k, flags, box=box, got=got: box.outer_step_async(g, got, k, flags).wait(),
                weight=samples(rank, i),
            )
            if not closed and not fused:
                box.pull(got)
            arrivals.append((q.last_ticket, i, closed, got.clone()))
        box.barrier()
        final = box.pull(torch.empty(NUMEL))
        state, counters = q.state(), q.counters(size)
        everyone = comm.gather(arrivals, root=0)
        if rank == 0:
            order = sorted((t, r, i, c, th) for r, mine in enumerate(everyone) for t, i, c, th in mine)
            assert [t for t, *_ in order] == list(range(size * ARRIVALS))
            seq = [(r, pseudo_gradient(r, i), samples(r, i), 0.0) for _, r, i, _, _ in order]
            after, closed = quorum_reference(theta0, seq, Q, LR, BETA)
            key = "fused" if fused else "worker_side"
            out[key] = {
                "closed": [c for *_, c, _ in order] == closed,
                "steps": sum(closed),
                "theta_after_each": max(float((th - w).abs().max()) for (*_, th), w in zip(order, after)),
                "final": float((final - after[-1]).abs().max()),
                "scale": float(after[-1].abs().max()),
            }
            if fused:  # the state goes out and back (a checkpoint and its resume)
                q.load_state(torch.zeros(2 * NUMEL))
                q.load_counters([0] * len(counters))
                q.load_state(state)
                q.load_counters(counters)
                out[key]["restored"] = float((q.state() - state).abs().max())
                out[key]["counters"] = q.counters(size) == counters and counters[0] == sum(closed)
        box.barrier()
        box.close()
    print(json.dumps(out), flush=True)


@pytest.mark.timeout(120)
def test_the_servers_quorum_step_is_the_closed_form_and_the_worker_side_step():
    from tests.conftest import mpi_rank0_result  # (not at the top: the file is also the worker)

    result = mpi_rank0_result(__file__)
    for key in ("fused", "worker_side"):
        r = result[key]
        tol = 1e-5 * max(1.0, r["scale"])
        assert r["closed"] and r["steps"] >= 1, (key, r)
        assert r["theta_after_each"] <= tol and r["final"] <= tol, (key, r)
    assert result["fused"]["restored"] == 0 and result["fused"]["counters"]


if __name__ == "__main__":
    worker()
