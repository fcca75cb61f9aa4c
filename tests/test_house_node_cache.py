"""Audit item 1: a node's sync cut short by a death counts no chunk twice (``box/node_cache.py``).

shm boxes stand in for the node's box and the cross-node box, and the cross box's exchange is the memory
server's own apply (``ServerBox.apply``, chunk by chunk, as its serving thread applies a remote push-pull) on
the cross box's buffer. The first sync dies after half its chunks landed; a node-mate's sync then finishes
the job: every element of the center is +1 after one +1 push, not +2 on the half that had landed.

The checks run in a process of their own: ``box/server.py`` imports mpi4py, which initialises MPI, and an
MPI singleton in the test process would spoil the ``mpiexec`` jobs of later tests there.
"""

from __future__ import annotations

import sys
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import run_checks, run_checks_in_own_process

N, CHUNK = 12, 3  # 4 chunks


class Died(Exception):
    """The syncing process's death, as its node-mates see it: its sync stopped half way."""


def _serve(cross, die_after: list[int | None]):
    """Give ``cross`` (an shm box) a memory server's push-pull: each chunk applied by ``ServerBox.apply``."""
    from parambox.box import server as srv

    state = SimpleNamespace(
        shard=cross.local_view().numpy(), lock=threading.Lock(), arrived={}, applied={}, my_start=0
    )

    def exchange(update, out, header):
        for lo in range(0, N, CHUNK):
            if die_after[0] is not None and lo // CHUNK == die_after[0]:
                die_after[0] = None
                raise Died
            srv.ServerBox.apply(state, header, lo, lo + CHUNK, update.numpy()[lo : lo + CHUNK])
            out[lo : lo + CHUNK] = torch.from_numpy(state.shard[lo : lo + CHUNK])
        return out

    cross.push_pull = lambda update, out, *a: exchange(update, out, srv.request_header(srv.PUSH_PULL, 0, N))
    cross.once = True
    cross.push_pull_once = lambda update, out, origin, seq: exchange(
        update, out, srv.request_header(srv.PUSH_PULL, 0, N, origin, 1.0, seq)
    )


def check_a_sync_cut_short_is_finished_by_a_node_mate_counting_each_chunk_once():
    from parambox.box import open_box
    from parambox.box.node_cache import NodeCachedBox
    from parambox.runtime.world import World

    tag = uuid.uuid4().hex[:8]
    cross = open_box("shm", World(), N, 3, name=f"cross-{tag}")
    node = open_box("shm", World(), 3 * N, 5, name=f"node-{tag}")
    try:
        die_after: list[int | None] = [None]
        _serve(cross, die_after)
        dying, mate = NodeCachedBox(cross, node, N, pushers=2), NodeCachedBox(cross, node, N, pushers=2)
        dying.write(torch.zeros(N))
        assert mate.pull(torch.empty(N)).tolist() == [0.0] * N  # the node's first sync
        dying.push(torch.ones(N))
        die_after[0] = 2  # the next sync dies after 2 of its 4 chunks reached the server
        try:
            dying.push(torch.zeros(N))  # the node's 2nd push: its sync
            raise AssertionError("the sync did not die")
        except Died:
            pass
        assert cross.pull(torch.empty(N)).tolist() == [1.0] * 6 + [0.0] * 6  # half landed
        mate.push(torch.full((N,), 0.5))
        assert mate.sync()
        got = cross.pull(torch.empty(N)).tolist()
        assert got == [1.5] * N, got  # +1 and +0.5 once each, every element
        assert mate.pull(torch.empty(N)).tolist() == [1.5] * N
        assert mate.sync()  # nothing pending: nothing more goes out
        assert cross.pull(torch.empty(N)).tolist() == [1.5] * N
    finally:
        node.close()
        cross.close()


def check_the_server_applies_a_chunk_once_per_origin_and_sequence_number():
    from parambox.box import server as srv

    state = SimpleNamespace(shard=torch.zeros(4).numpy(), lock=threading.Lock(), arrived={}, applied={})
    one = torch.ones(2).numpy()
    for origin, seq in [(1, 7), (1, 7), (2, 7), (1, 8)]:  # a resend, another node, the next sync
        srv.ServerBox.apply(state, srv.request_header(srv.PUSH_PULL, 0, 2, origin, 1.0, seq), 0, 2, one)
    srv.ServerBox.apply(state, srv.request_header(srv.PUSH_PULL, 0, 2), 2, 4, one)  # plain: every time
    srv.ServerBox.apply(state, srv.request_header(srv.PUSH_PULL, 0, 2), 2, 4, one)
    assert state.shard.tolist() == [3.0, 3.0, 2.0, 2.0]


CHECKS = [
    ("check_a_sync_cut_short_is_finished_by_a_node_mate_counting_each_chunk_once",),
    ("check_the_server_applies_a_chunk_once_per_origin_and_sequence_number",),
]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    return run_checks_in_own_process(__file__, CHECKS)  # one interpreter for both


def test_a_sync_cut_short_is_finished_by_a_node_mate_counting_each_chunk_once(outcomes):
    call = ("check_a_sync_cut_short_is_finished_by_a_node_mate_counting_each_chunk_once",)
    assert outcomes[call] == "ok", outcomes[call]


def test_the_server_applies_a_chunk_once_per_origin_and_sequence_number(outcomes):
    call = ("check_the_server_applies_a_chunk_once_per_origin_and_sequence_number",)
    assert outcomes[call] == "ok", outcomes[call]


if __name__ == "__main__":
    run_checks(globals(), sys.argv[1])
