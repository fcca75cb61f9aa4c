"""Every wait of the rma box and of the MPI rendezvous has a deadline (issue 21): with one rank absent,
each blocking step raises ``CommTimeout`` after its timeout instead of hanging.

Two ranks under mpiexec. Both make four communicators and one window together; then rank 1 stops
taking part, and rank 0 times out on each of: duplicating a communicator (``Idup``), allocating a
window (``Win.Allocate`` in a helper thread), freeing one (``Win.Free``), and opening a box (the
agreement ``Iallgather``). Rank 0 never posts the rendezvous address, so rank 1 times out on its
``Ibcast``. Run as a script this file is the worker; it prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TIMEOUT_S = 1.0


def worker() -> None:
    from mpi4py import MPI

    from parambox.box.rma import bounded, open_rma_box, wait_request
    from parambox.errors import CommTimeout
    from parambox.runtime.dist import rendezvous_address
    from parambox.runtime.world import World

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comms = [world.Dup() for _ in range(4)]
    window = MPI.Win.Allocate(64, 4, comm=comms[3])
    world.Barrier()  # from here on the other rank takes no part
    results: dict[str, dict] = {}

    def timed(name: str, call) -> None:
        t0 = time.monotonic()
        try:
            call()
            outcome = "returned"
        except CommTimeout as e:
            outcome = f"CommTimeout: {e}"
        results[name] = {"outcome": outcome, "s": time.monotonic() - t0}

    if rank == 0:
        timed("Idup", lambda: wait_request(comms[0].Idup()[1], TIMEOUT_S, "duplicating"))
        timed(
            "Win.Allocate",
            lambda: bounded(lambda: MPI.Win.Allocate(64, 4, comm=comms[1]), TIMEOUT_S, "alloc"),
        )
        timed("Win.Free", lambda: bounded(window.Free, TIMEOUT_S, "freeing"))
        me = World(0, 2, 0, 2, 0, 1, "mpi")
        timed("open_box", lambda: open_rma_box(me, 1000, 1, "lonely", timeout=TIMEOUT_S, comm=comms[2]))
    else:
        timed("Ibcast", lambda: rendezvous_address(World(1, 2, 1, 2, 0, 1, "mpi"), timeout_s=TIMEOUT_S))
    print(json.dumps({"rank": rank, **results}), flush=True)
    # Helper threads are still blocked in MPI, so no MPI_Finalize; a rank that exits first would have
    # mpiexec kill the other: each waits (through files) until both are done.
    done = Path(os.environ["DEADLINES_DIR"])
    (done / str(rank)).touch()
    while len(list(done.iterdir())) < 2:
        time.sleep(0.05)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_rma_wait_gives_up_at_its_deadline(tmp_path):
    from tests.conftest import MPI_ENV, run_mpi_script  # (not at the top: the file is also the worker)

    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1", "DEADLINES_DIR": str(tmp_path)}
    stdout, stderr, _ = run_mpi_script(__file__, 2, env)
    lines = {x["rank"]: x for x in (json.loads(s) for s in stdout.splitlines() if s.startswith("{"))}
    assert sorted(lines) == [0, 1], stderr[-3000:]
    waits = {**lines[0], **lines[1]}
    for name in ("Idup", "Win.Allocate", "Win.Free", "open_box", "Ibcast"):
        result = waits[name]
        assert result["outcome"].startswith("CommTimeout"), (name, result)
        assert TIMEOUT_S * 0.9 <= result["s"] < TIMEOUT_S + 5, (name, result)
    assert "not every rank arrived" in waits["open_box"]["outcome"]
    assert "rank 0 did not post the rendezvous address" in waits["Ibcast"]["outcome"]


if __name__ == "__main__":
    worker()
