"""Asynchronous DiLoCo's outer step applied by the rma box's memory server (issue 17): the same
arrivals give the same theta, momentum and block accumulator as Liu et al.'s Alg. 3 run in one
process, and as the worker-side step on the same box; the state goes out and back for checkpoints.

Two ranks under mpiexec, each holding half of the box (so every request meets one local shard and one
remote one), with 300,007 parameters (more than one server message per shard). Each rank makes 5
arrivals with pseudo-gradients seeded by (rank, arrival), in whatever order the ticket lock gives
them; every arrival records its ticket and the theta it got back. Rank 0 rebuilds the sequence in
ticket order and checks it against the closed form. Run as a script this file is the worker.
"""

from __future__ import annotations

import json

import pytest

NUMEL = 300_007
ARRIVALS = 5
LR, BETA, C = 0.7, 0.5, 0.2


def pseudo_gradient(rank: int, i: int):
    import torch

    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + i))


def alg3(theta0, gs, n: int, lr: float, beta: float, c: float):
    """Delayed Nesterov with activation ``c``, the arrivals one after another: theta after each, m, a."""
    import torch

    theta, m, a = theta0.clone(), torch.zeros_like(theta0), torch.zeros_like(theta0)
    after = []
    for t, g in enumerate(gs):
        a += g / n
        if (t + 1) % n == 0:
            m, a = beta * m + a, torch.zeros_like(a)
            theta -= lr * ((1 - c * n + c) * beta * m + g / n)
        else:
            theta -= lr * (c * beta * m + g / n)
        after.append(theta.clone())
    return after, m, a


def worker() -> None:
    import torch
    from mpi4py import MPI

    from parambox.box import open_box
    from parambox.runtime.world import World
    from parambox.strategies.delayed_nesterov import DelayedNesterov

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    world = World(rank, size, rank, size, 0, 1, "mpi")
    theta0 = torch.linspace(-1, 1, NUMEL)
    out: dict = {"rank": rank}
    for fused in (True, False):
        box = open_box("rma", world, 3 * NUMEL, 2, f"outer{int(fused)}", server=True, timeout=30.0)
        if not fused:  # the worker-side step on the same box, for comparison
            box.fuses_outer_step = False
        if rank == 0:
            box.write(theta0)
        box.barrier()
        dn = DelayedNesterov(box, NUMEL, NUMEL, 2 * NUMEL, 0, LR, BETA, size, C)
        got = torch.empty(NUMEL)
        arrivals = []
        for i in range(ARRIVALS):
            g = pseudo_gradient(rank, i)
            dn.apply_(
                g,
                lambda u, s, box=box, got=got: box.push_pull(u, got, s),
                lambda g, k, last, box=box, got=got: box.outer_step_async(g, got, k, last).wait(),
            )
            arrivals.append((dn.last_ticket, i, got.clone()))
        box.barrier()
        final = box.pull(torch.empty(NUMEL))
        state = dn.state()
        everyone = comm.gather(arrivals, root=0)
        if rank == 0:
            order = sorted((t, r, i, theta) for r, mine in enumerate(everyone) for t, i, theta in mine)
            assert [t for t, *_ in order] == list(range(size * ARRIVALS))
            after, m, a = alg3(theta0, [pseudo_gradient(r, i) for _, r, i, _ in order], size, LR, BETA, C)
            key = "fused" if fused else "worker_side"
            out[key] = {
                "theta_after_each": max(
                    float((th - want).abs().max()) for (*_, th), want in zip(order, after)
                ),
                "final": float((final - after[-1]).abs().max()),
                "m": float((state[:NUMEL] - m).abs().max()),
                "a": float((state[NUMEL:] - a).abs().max()),
                "scale": float(after[-1].abs().max()),
            }
            if fused:  # the state goes out and back (a checkpoint and its resume)
                dn.load_state(torch.zeros(2 * NUMEL))
                zeroed = float(dn.state().abs().max())
                dn.load_state(state)
                out[key]["restored"] = float((dn.state() - state).abs().max())
                out[key]["zeroed"] = zeroed
        box.barrier()
        box.close()
    print(json.dumps(out), flush=True)


@pytest.mark.timeout(120)
def test_the_servers_outer_step_is_alg3_and_the_worker_side_step(tmp_path):
    from tests.conftest import mpi_rank0_result  # (not at the top: the file is also the worker)

    result = mpi_rank0_result(__file__)
    for key in ("fused", "worker_side"):
        r = result[key]
        tol = 1e-5 * max(1.0, r["scale"])
        assert r["theta_after_each"] <= tol and r["final"] <= tol, (key, r)
        assert r["m"] <= tol and r["a"] <= tol, (key, r)
    assert result["fused"]["zeroed"] == 0 and result["fused"]["restored"] == 0


if __name__ == "__main__":
    worker()
