"""``diloco`` with a quorum (``diloco.quorum``, ``grace_s``): the weighted outer step against a hand-written
reference (tier a), applied by the worker (shm box) and by the memory server's fused step; an arrival cut
short leaves the server's shard as it was; the options that cannot apply are refused in one line.

Must show (issue 51, item 3): a closed-form test of the weighted outer step (here); the 4-worker run with one
5x slower worker is ``test_quorum_run.py``.
"""

from __future__ import annotations

import sys
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parambox.box import open_box
from parambox.runtime.world import World
from parambox.strategies.delayed_nesterov import QUORUM_COUNTERS, QUORUM_FLAG, QuorumNesterov, TicketLock
from tests.conftest import run_checks, run_checks_in_own_process

N, RANKS, LR, BETA = 5, 3, 0.7, 0.9
# (rank, seed of g, samples, time s): rank 0 twice before rank 1 (Q = 2: both of rank 0's count once, all
# three weigh in), then a step of ranks 2 and 0, then rank 1 alone until the grace window (3 s) has passed.
ARRIVALS = [(0, 1, 32, 0.0), (0, 2, 16, 0.5), (1, 3, 8, 0.7), (2, 4, 24, 1.0), (0, 5, 40, 1.2)]
ARRIVALS += [(1, 6, 12, 2.0), (1, 7, 20, 5.5), (2, 8, 4, 6.0), (1, 9, 4, 6.1)]


def pseudo_gradient(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def quorum_reference(
    theta0: torch.Tensor,
    arrivals: list[tuple[int, torch.Tensor, float, float]],
    q: int,
    lr: float = LR,
    beta: float = BETA,
    grace_s: float | None = None,
    closing: tuple[int, ...] = (),
) -> tuple[list[torch.Tensor], list[bool]]:
    """Decoupled DiLoCo's step written out, for ``(rank, g, samples, time s)`` arrivals in order: the pending
    arrivals' sample-weighted mean, one Nesterov step (torch's SGD) once ``q`` distinct workers are pending
    or an arrival comes ``grace_s`` after the first (or it is one of ``closing``); theta after each
    arrival, and which closed a step."""
    p = torch.nn.Parameter(theta0.clone())
    outer = torch.optim.SGD([p], lr=lr, momentum=beta, nesterov=True)
    pending: list[tuple[int, torch.Tensor, float]] = []
    first = 0.0
    history, closed = [], []
    for k, (rank, g, w, t) in enumerate(arrivals):
        if not pending:
            first = t
        pending.append((rank, g, w))
        late = grace_s is not None and t - first >= grace_s
        close = len({r for r, _, _ in pending}) >= q or late or k in closing
        if close:
            p.grad = sum(w * g for _, g, w in pending) / sum(w for _, _, w in pending)
            outer.step()
            pending = []
        history.append(p.detach().clone())
        closed.append(close)
    return history, closed


def reference(theta0: torch.Tensor, q: int, grace_s: float | None) -> tuple[list[torch.Tensor], list[bool]]:
    arrivals = [(rank, pseudo_gradient(seed), w, t) for rank, seed, w, t in ARRIVALS]
    return quorum_reference(theta0, arrivals, q, grace_s=grace_s)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return 1e6 + self.now  # any epoch


def run_arrivals(
    box, q: int, grace_s: float | None, fused_step=None
) -> tuple[list[torch.Tensor], list[bool]]:
    """The arrivals through ``QuorumNesterov``, one per rank's object, over ``box`` (theta at 0, m, a after)."""
    clock = Clock()
    lock = TicketLock(box, 0)
    workers = [
        QuorumNesterov(box, N, N, 2 * N, lock, 2, LR, BETA, q, r, grace_s, clock) for r in range(RANKS)
    ]
    history, closed = [], []
    for rank, seed, w, t in ARRIVALS:
        clock.now = t
        closed.append(workers[rank].apply_(pseudo_gradient(seed), lambda u, s: box.push(u, s), fused_step, w))
        history.append(box.pull(torch.empty(N)))
    return history, closed


@pytest.fixture
def box():
    b = open_box("shm", World(), 3 * N, 2 + QUORUM_COUNTERS + RANKS, name=f"quorum-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


@pytest.mark.parametrize("q,grace_s", [(2, 3.0), (2, None), (3, None), (1, None)])
def test_the_quorum_step_is_the_weighted_nesterov_step_of_the_pending_arrivals(box, q, grace_s):
    """Applied by the worker with box operations (the shm box): theta after every arrival, and which closed."""
    theta0 = torch.linspace(-1, 1, N)
    box.write(theta0)
    got, closed = run_arrivals(box, q, grace_s)
    want, want_closed = reference(theta0, q, grace_s)
    assert closed == want_closed
    if q == 2 and grace_s == 3.0:  # the scenario's point: rank 1 alone waits until the grace window ends
        assert want_closed == [False, False, True, False, True, False, True, False, True]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert box.read_counter(2) == sum(want_closed)  # steps applied


def test_the_quorum_waits_for_live_workers_only(box):
    """Q = 3 with 2 workers still in the run: 2 close the step; the last worker's push without samples
    closes the pending step (it adds nothing to the mean); with nothing pending it does nothing."""
    theta0 = torch.linspace(-1, 1, N)
    box.write(theta0)
    lock = TicketLock(box, 0)
    live = [3]
    workers = [
        QuorumNesterov(box, N, N, 2 * N, lock, 2, LR, BETA, 3, r, live=lambda: live[0]) for r in range(3)
    ]
    g = [pseudo_gradient(seed) for seed in range(4)]
    push = lambda u, s: box.push(u, s)  # noqa: E731
    assert not workers[0].apply_(g[0], push, weight=10)
    live[0] = 2  # rank 2 is done (or lost)
    assert workers[1].apply_(g[1], push, weight=30)
    assert not workers[0].apply_(torch.zeros(N), push, weight=0)  # nothing pending: nothing
    assert not workers[0].apply_(g[2], push, weight=20)
    live[0] = 1  # rank 0 is done too
    assert workers[1].apply_(torch.zeros(N), push, weight=0)  # closes rank 0's alone
    arrivals = [(0, g[0], 10, 0.0), (1, g[1], 30, 0.0), (0, g[2], 20, 0.0)]
    want, _ = quorum_reference(theta0, arrivals, 2, closing=(2,))
    assert torch.allclose(box.pull(torch.empty(N)), want[-1], atol=1e-5)  # steps: [g0, g1] 10:30, [g2]
    assert box.read_counter(2) == 2 and box.read_counter(3) == 0  # two steps, nothing pending


def test_a_checkpoint_keeps_the_pending_step(box):
    """The pending arrivals' mean (``state``) and counters put back into a fresh box give the same steps."""
    theta0 = torch.linspace(-1, 1, N)
    box.write(theta0)
    q = QuorumNesterov(box, N, N, 2 * N, TicketLock(box, 0), 2, LR, BETA, 3, 0)
    q.apply_(pseudo_gradient(1), lambda u, s: box.push(u, s), weight=10)
    saved, counters = q.state().clone(), q.counters(RANKS)
    again = open_box(
        "shm", World(), 3 * N, 2 + QUORUM_COUNTERS + RANKS, name=f"quorum-{uuid.uuid4().hex[:8]}"
    )
    try:
        again.write(theta0)
        fresh = QuorumNesterov(again, N, N, 2 * N, TicketLock(again, 0), 2, LR, BETA, 3, 0)
        fresh.load_state(saved)
        fresh.load_counters(counters)
        for b in (box, again):
            for r, w in ((1, 30), (2, 20)):
                QuorumNesterov(b, N, N, 2 * N, TicketLock(b, 0), 2, LR, BETA, 3, r).apply_(
                    pseudo_gradient(r + 1), lambda u, s, b=b: b.push(u, s), weight=w
                )
        assert torch.allclose(box.pull(torch.empty(N)), again.pull(torch.empty(N)), atol=1e-6)
        assert not torch.allclose(box.pull(torch.empty(N)), theta0)
    finally:
        again.close()


def test_options_that_cannot_apply_are_refused_in_one_line():
    from parambox.errors import UserError
    from parambox.strategies.diloco import AsyncDiloco, Diloco, DilocoOptions

    with pytest.raises(UserError, match="asynchronous=true"):
        Diloco.resolve(DilocoOptions(quorum=2))
    assert Diloco.resolve(DilocoOptions(quorum=0)) is Diloco  # 0: today's behaviour
    with pytest.raises(ValueError):
        DilocoOptions(asynchronous=True, quorum=2, grace_s=0)
    four = SimpleNamespace(num_workers=4)
    AsyncDiloco._check_quorum(four, DilocoOptions(asynchronous=True, quorum=4))
    with pytest.raises(UserError, match="quorum=5 is more than the 4 workers"):
        AsyncDiloco._check_quorum(four, DilocoOptions(asynchronous=True, quorum=5))
    for delayed_nesterov in ({"buffer_size": 2}, {"momentum_activation": 0.1}):
        with pytest.raises(UserError, match="unset diloco.buffer_size"):
            AsyncDiloco._check_quorum(four, DilocoOptions(asynchronous=True, quorum=2, **delayed_nesterov))


def test_a_quorum_brings_its_own_default_outer_lr_and_the_users_wins():
    """Typed by name, a quorum run trains: its default outer_lr is 0.35 (QuorumDiloco's docstring has the
    sweep: Delayed Nesterov's 0.7 overshoots a quorum's step); a value the user sets is kept."""
    from parambox.config import build_config
    from parambox.presets import PRESETS

    def outer_lr(*layers: dict) -> float:
        return build_config(*layers).strategy_options().outer_lr

    quorum = {"strategy": "diloco", "options": {"diloco": {"asynchronous": True, "quorum": 3}}}
    assert outer_lr(quorum) == 0.35
    assert outer_lr({"strategy": "diloco", "options": {"diloco": {"asynchronous": True}}}) == 0.7
    assert outer_lr(quorum, {"options": {"diloco": {"outer_lr": 0.5}}}) == 0.5
    assert outer_lr(PRESETS["digits-diloco-async"](), {"options": {"diloco": {"quorum": 3}}}) == 0.35


# -- the memory server's fused step (in a process of its own: box/server.py imports mpi4py, see
# tests/test_house_outer_step.py) ------------------------------------------------------------------------


def _server_box(numel: int):
    from parambox.box import server as srv

    box = srv.ServerBox.__new__(srv.ServerBox)  # the shard's state only: no communicator
    box.shard = np.zeros(numel, dtype=np.float32)
    box.lock, box._companion_lock = threading.Lock(), threading.Lock()
    box._companion = None
    box.arrived, box.applied = {}, {}
    return box


class _FusedBox:
    """An shm box for the counters and the ticket lock, the server's shard and companions for theta."""

    fuses_outer_step = True

    def __init__(self, counters, server):
        self.counters, self.server = counters, server

    def __getattr__(self, name):
        return getattr(self.counters, name)

    def push(self, *_):
        raise AssertionError("the fused path pushes nothing")

    def pull(self, out, start=0):
        assert start == 0
        return out.copy_(torch.from_numpy(self.server.shard))

    def write(self, src, start=0):
        self.server.shard[:] = src.numpy()

    def pull_companion(self, out, row, start=0):
        return out.copy_(torch.from_numpy(self.server.companion()[row]))


def check_the_servers_fused_quorum_step_equals_the_reference() -> None:
    from parambox.box import server as srv

    assert srv.QUORUM == QUORUM_FLAG
    theta0 = torch.linspace(-1, 1, N)
    counters = open_box("shm", World(), 1, 2 + QUORUM_COUNTERS + RANKS, name=f"quorum-{uuid.uuid4().hex[:8]}")
    try:
        box = _FusedBox(counters, _server_box(N))
        box.write(theta0)

        def fused(g, k, flags):
            box.server._outer(0, N, g.numpy(), flags, *k)  # as its own rank's arrival: at once

        for q, grace_s in [(2, 3.0), (3, None)]:
            box.write(theta0)
            box.server._companion = None
            for i in range(2 + QUORUM_COUNTERS + RANKS):
                counters.set_counter(i, 0)
            got, closed = run_arrivals(box, q, grace_s, fused)
            want, want_closed = reference(theta0, q, grace_s)
            assert closed == want_closed, (closed, want_closed)
            for a, b in zip(got, want):
                assert torch.allclose(a, b, atol=1e-5), (a, b)
    finally:
        counters.close()


def check_a_quorum_arrival_cut_short_is_applied_to_nothing(last: str) -> None:
    """The server's serving loop (as tests/test_house_outer_step.py): a sender that dies after 2 of 4
    chunks leaves theta and the pending mean as they were; landed whole, it equals the step at once."""
    from parambox.box import server as srv

    chunk, n = 3, 12
    flags = srv.QUORUM | int(last == "True")
    coefficients = (0.7, 0.9, 0.25, 0.0, 0.0)
    rng = np.random.default_rng(0)
    start = rng.standard_normal(n).astype(np.float32), rng.standard_normal((2, n)).astype(np.float32)
    box = _server_box(n)
    box.shard[:], box._companion = start[0], start[1].copy()
    server = srv._Server.__new__(srv._Server)
    server.box, server.comm = box, type("Comm", (), {"Isend": lambda *a: None})()
    job = srv._Job(1, srv.request_header(srv.OUTER, 0, n, flags, *coefficients), deadline=float("inf"))
    landed = [[False] for _ in range(0, n, chunk)]
    job.keep = [np.arange(n, dtype=np.float32)]
    done = type("Done", (), {"__init__": lambda s, f: setattr(s, "f", f), "Test": lambda s: s.f[0]})
    job.recvs = [(done(landed[i]), lo, lo + chunk) for i, lo in enumerate(range(0, n, chunk))]
    landed[0][0] = landed[1][0] = True
    server._advance(job)
    assert np.array_equal(box.shard, start[0]) and np.array_equal(box._companion, start[1])
    for flag in landed[2:]:
        flag[0] = True
    server._advance(job)
    reference_box = _server_box(n)
    reference_box.shard[:], reference_box._companion = start[0], start[1].copy()
    reference_box._outer(0, n, job.keep[0], flags, *coefficients)
    assert np.allclose(box.shard, reference_box.shard) and np.allclose(
        box._companion, reference_box._companion
    )
    assert np.array_equal(box.shard, start[0]) != (last == "True")  # theta moves only at a step


CHECKS = [
    ("check_the_servers_fused_quorum_step_equals_the_reference",),
    ("check_a_quorum_arrival_cut_short_is_applied_to_nothing", "False"),
    ("check_a_quorum_arrival_cut_short_is_applied_to_nothing", "True"),
]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    return run_checks_in_own_process(__file__, CHECKS)  # one interpreter for the three


def test_the_servers_fused_quorum_step_equals_the_reference(outcomes):
    call = ("check_the_servers_fused_quorum_step_equals_the_reference",)
    assert outcomes[call] == "ok", outcomes[call]


@pytest.mark.parametrize("last", [False, True])
def test_a_quorum_arrival_cut_short_is_applied_to_nothing(outcomes, last):
    call = ("check_a_quorum_arrival_cut_short_is_applied_to_nothing", str(last))
    assert outcomes[call] == "ok", outcomes[call]


if __name__ == "__main__":
    run_checks(globals(), sys.argv[1])
