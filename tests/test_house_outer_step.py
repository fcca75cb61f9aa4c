"""Audit item 3: the memory server's fused outer step (asynchronous DiLoCo) is applied whole or not at all.

The serving loop's own code (``_Server._advance``) on a shard of 4 chunks, with stand-ins for MPI's requests:
an arrival whose sender dies after 2 chunks landed leaves theta, the momentum and the accumulator as they were
(before, the 2 chunks were applied, momentum included); one that lands whole equals the step applied at once.

The checks run in a process of their own: ``box/server.py`` imports mpi4py, which initialises MPI, and an
MPI singleton in the test process would spoil the ``mpiexec`` jobs of later tests there.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from tests.conftest import run_checks, run_checks_in_own_process

CHUNK, N = 3, 12
COEFFS = (0.7, 0.9, 0.5, 0.2, -0.8)  # lr, beta, 1 / N, k, k_last


class _Done:
    def __init__(self, landed):
        self.landed = landed

    def Test(self):  # noqa: N802 (MPI's name)
        return self.landed[0]


class _Comm:
    def Isend(self, buf, dest, tag):  # noqa: N802
        return None


def _box(seed: int):
    from parambox.box import server as srv

    box = srv.ServerBox.__new__(srv.ServerBox)  # the shard's state only: no communicator
    rng = np.random.default_rng(seed)
    box.shard = rng.standard_normal(N).astype(np.float32)
    box.lock, box._companion_lock = threading.Lock(), threading.Lock()
    box._companion = rng.standard_normal((2, N)).astype(np.float32)
    box.arrived, box.applied = {}, {}
    return box


def check_an_arrival_cut_short_is_applied_to_nothing_and_a_whole_one_as_at_once(last: str) -> None:
    from parambox.box import server as srv

    last_ = last == "True"
    g = np.arange(N, dtype=np.float32)
    box = _box(0)
    before = box.shard.copy(), box._companion.copy()
    server = srv._Server.__new__(srv._Server)
    server.box, server.comm = box, _Comm()
    job = srv._Job(1, srv.request_header(srv.OUTER, 0, N, int(last_), *COEFFS), deadline=float("inf"))
    landed = [[False] for _ in range(0, N, CHUNK)]
    job.keep = [g]
    job.recvs = [(_Done(landed[i]), lo, lo + CHUNK) for i, lo in enumerate(range(0, N, CHUNK))]
    landed[0][0] = landed[1][0] = True  # 2 of 4 chunks land; the sender dies
    server._advance(job)
    assert job.next == 2
    assert np.array_equal(box.shard, before[0]), "theta moved"
    assert np.array_equal(box._companion, before[1]), "the momentum or the accumulator moved"
    for flag in landed[2:]:  # (the same arrival, whole: the last chunks land too)
        flag[0] = True
    server._advance(job)
    reference = _box(0)
    reference._outer(0, N, g, last_, *COEFFS)  # the step at once (an arrival on the server's own rank)
    assert np.allclose(box.shard, reference.shard) and np.allclose(box._companion, reference._companion)


CHECK = "check_an_arrival_cut_short_is_applied_to_nothing_and_a_whole_one_as_at_once"


@pytest.fixture(scope="module")
def outcomes() -> dict:
    return run_checks_in_own_process(
        __file__, [(CHECK, "False"), (CHECK, "True")]
    )  # one interpreter for both


@pytest.mark.parametrize("last", [False, True])
def test_an_arrival_cut_short_is_applied_to_nothing_and_a_whole_one_as_at_once(outcomes, last):
    assert outcomes[(CHECK, str(last))] == "ok", outcomes[(CHECK, str(last))]


if __name__ == "__main__":
    run_checks(globals(), sys.argv[1])
