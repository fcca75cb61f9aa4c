"""Tier (a): each asynchronous update rule against its formula, two workers, hand-computed values.

The two workers are two clients of one real ``shm`` box in this process, interleaved by hand.
"""

from __future__ import annotations

import collections
import math
import threading
import uuid

import pytest
import torch

from parambox.box import open_box
from parambox.box.base import Count
from parambox.runtime.world import World
from parambox.strategies.asynchronous import CenterClient, CounterMap
from parambox.strategies.downpour import AdagradRates, DownpourWorker
from parambox.strategies.easgd import NesterovStep, sync_elastic_
from parambox.strategies.membership import COUNTS_IN_FLIGHT, Membership

N = 5  # parameters per replica


@pytest.fixture
def box():
    b = open_box("shm", World(), 2 * N, CounterMap(2).num_counters, name=f"rules-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def center(box, start: int = 0) -> torch.Tensor:
    return box.pull(torch.empty(N), start)


def full(v: float) -> torch.Tensor:
    return torch.full((N,), float(v))


def test_easgd_async_exchange(box):
    """d = alpha (x - c); x <- x - d; c <- c + d, worker A then worker B."""
    a, b = CenterClient(box, N), CenterClient(box, N, block=2)  # B walks the buffer in blocks of 2
    xa, xb = full(1.0), full(2.0)
    assert a.elastic_(xa, 0.5)  # d = 0.5 (1 - 0) = 0.5
    assert torch.equal(xa, full(0.5)) and torch.equal(center(box), full(0.5))
    assert b.elastic_(xb, 0.5)  # d = 0.5 (2 - 0.5) = 0.75
    assert torch.equal(xb, full(1.25)) and torch.equal(center(box), full(1.25))
    assert (a.staleness, b.staleness) == (0, 0)
    assert box.read_counter(0) == 2


def test_easgd_sync_exchange():
    """c <- c + alpha sum_i (x_i - c); x_i <- x_i - alpha (x_i - c); every worker keeps its own c."""
    xs, cs = [full(1.0), full(3.0)], [full(0.0), full(0.0)]
    bufs = [torch.zeros(N), torch.zeros(N)]
    barrier = threading.Barrier(2)

    def allreduce(t: torch.Tensor) -> None:  # the two "workers" are threads here
        barrier.wait()
        total = bufs[0] + bufs[1]
        barrier.wait()
        t.copy_(total)

    threads = [
        threading.Thread(target=sync_elastic_, args=(xs[i], cs[i], bufs[i], 0.25, allreduce))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(cs[0], full(1.0)) and torch.equal(cs[1], full(1.0))  # 0 + 0.25 (1 + 3)
    assert torch.equal(xs[0], full(0.75)) and torch.equal(xs[1], full(2.25))


def test_eamsgd_nesterov_step():
    """v <- delta v - eta g(x + delta v); x <- x + v, on f(x) = x^2 / 2 (g(x) = x)."""
    x = full(1.0)
    s = NesterovStep(x, lr=0.1, delta=0.5)
    for _ in range(2):
        s.lookahead_()
        s.step_(x.clone())  # the gradient at the look-ahead point
    # step 1: g(1) = 1, v = -0.1, x = 0.9; step 2: g(0.9 - 0.05) = 0.85, v = -0.05 - 0.085, x = 0.765
    assert torch.allclose(s.v, full(-0.135)) and torch.allclose(x, full(0.765))


def test_eamsgd_nesterov_step_decays_the_trainable_part_by_the_groups_weight_decay():
    """g <- g + wd x where ``decays`` is 1: x = 1 everywhere, g = 0, eta = 0.1, wd = 0.5, delta = 0.5."""
    x = full(1.0)
    decays = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])  # the last two: a frozen parameter's
    s = NesterovStep(x, 0.1, 0.5, {"lr": 0.1, "weight_decay": 0.5}, decays)
    s.lookahead_()
    s.step_(torch.zeros(N))  # v = -0.1 * 0.5 * 1 = -0.05, x = 1 - 0.05
    assert torch.allclose(x, torch.tensor([0.95, 0.95, 0.95, 1.0, 1.0]))
    assert torch.allclose(s.v, torch.tensor([-0.05, -0.05, -0.05, 0.0, 0.0]))


def test_eamsgd_nesterov_step_follows_a_scheduled_momentum():
    """delta is the group's momentum at each step (OneCycleLR cycles it): 0.5, then 0."""
    x, group = full(1.0), {"lr": 0.1, "momentum": 0.5}
    s = NesterovStep(x, 0.1, 0.5, group)
    s.lookahead_()
    s.step_(torch.ones(N))  # v = -0.1, x = 0.9
    group["momentum"] = 0.0
    s.lookahead_()  # x + 0 v
    s.step_(torch.ones(N))  # v = 0 v - 0.1 = -0.1, x = 0.8
    assert torch.allclose(x, full(0.8)) and torch.allclose(s.v, full(-0.1))


def sgd(worker: DownpourWorker, g: float, lr: float = 0.1) -> None:
    worker.x.sub_(lr * g)


def test_downpour_fetch_every_2_push_every_step(box):
    a = DownpourWorker(CenterClient(box, N), full(7.0), n_fetch=2, n_push=1)
    b = DownpourWorker(CenterClient(box, N), full(7.0), n_fetch=2, n_push=1)
    expected_c = [-0.1, -0.3, -0.4, -0.6]  # A: -0.1 per step, B: -0.2 per step, each pushed at once
    expected_x = [-0.1, -0.3, -0.2, -0.5]  # B fetched c = -0.1 at step 0; nobody fetches at step 1
    k = 0
    for step in range(2):
        for w, g in ((a, 1.0), (b, 2.0)):
            w.before_step(step)
            sgd(w, g)
            assert w.after_step(step)
            assert torch.allclose(center(box), full(expected_c[k])), k
            assert torch.allclose(w.x, full(expected_x[k])), k
            k += 1


def test_downpour_fetch_every_step_push_every_2_keeps_the_update(box):
    """A fetch between two pushes replaces x but not the update accumulated before it."""
    a = DownpourWorker(CenterClient(box, N), full(0.0), n_fetch=1, n_push=2)
    b = DownpourWorker(CenterClient(box, N), full(0.0), n_fetch=1, n_push=2)
    for step in range(2):
        for w, g in ((a, 1.0), (b, 2.0)):
            w.before_step(step)
            sgd(w, g)
            w.after_step(step)
    # A pushed -0.1 - 0.1, then B pushed -0.2 - 0.2: every local update reached c exactly once.
    assert torch.allclose(center(box), full(-0.6))
    assert torch.allclose(b.x, full(-0.4))  # B fetched c = -0.2 at step 1, then stepped -0.2


def test_downpour_adagrad_rates_from_squared_sums_in_the_box(box):
    """eta_j = gamma / sqrt(sum of g_j^2 over every worker's pushes), the sums kept in the box."""
    workers = []
    for _ in range(2):
        x = full(0.0)
        w = DownpourWorker(CenterClient(box, N), x, 1, 1)
        workers.append((w, AdagradRates(CenterClient(box, N, start=N), N, gamma=0.1, device=x.device)))

    def step(i: int, g: float) -> None:
        w, rates = workers[i]
        w.fetch()
        rates.fetch()
        rates.step_(w.x, full(g))
        assert w.push() and rates.push()

    step(0, 1.0)  # G = 1: x_A = -0.1
    c1 = -0.1
    assert torch.allclose(center(box), full(c1)) and torch.allclose(center(box, N), full(1.0))
    step(1, 2.0)  # G = 1 + 4: B moves by -0.1 * 2 / sqrt(5)
    c2 = c1 - 0.2 / math.sqrt(5)
    assert torch.allclose(center(box), full(c2)) and torch.allclose(center(box, N), full(5.0))
    step(0, 1.0)  # G = 5 + 1
    assert torch.allclose(center(box), full(c2 - 0.1 / math.sqrt(6)))


def test_dynsgd_push_scaled_by_staleness(box):
    """Both pull c = 0; A pushes first (s = 0, scale 1); B's push saw one push since its pull (scale 1/2)."""
    a = DownpourWorker(CenterClient(box, N), full(0.0), 1, 1, damped=True)
    b = DownpourWorker(CenterClient(box, N), full(0.0), 1, 1, damped=True)
    a.before_step(0)
    b.before_step(0)
    sgd(a, 1.0)
    assert a.after_step(0)
    sgd(b, 2.0)
    assert b.after_step(0)
    assert (a.client.staleness, b.client.staleness) == (0, 1)
    assert torch.allclose(center(box), full(-0.1 - 0.2 / 2))


def test_non_finite_updates_are_never_pushed(box):
    client = CenterClient(box, N, block=2)
    box.write(full(1.0), 0)
    assert not client.push(torch.tensor([0.0, 1.0, float("nan"), 0.0, 0.0]))
    assert not client.push(full(float("inf")))
    x = torch.tensor([3.0, 3.0, 3.0, float("inf"), 3.0])  # the exchange is refused as a whole
    assert not client.elastic_(x, 0.5)
    assert torch.equal(center(box), full(1.0))  # no block of it was pushed (x - c = 2 elsewhere)
    assert torch.equal(x[:3], full(3.0)[:3])  # nor applied to x
    assert box.read_counter(0) == 0  # the version counts only accepted pushes


def test_adagrad_sums_do_not_count_as_pushes(box):
    """Staleness counts other workers' pushes of c: the squared sums beside it are no push of their own."""
    big = open_box("shm", World(), 2 * N, CounterMap(2).num_counters, name=f"ada-{uuid.uuid4().hex[:8]}")
    try:
        pairs = []
        for _ in range(2):
            x = full(0.0)
            w = DownpourWorker(CenterClient(big, N), x, 1, 1)
            pairs.append((w, AdagradRates(CenterClient(big, N, start=N), N, gamma=0.1, device=x.device)))
        for w, rates in pairs:
            w.fetch()
            rates.fetch()
        for w, rates in pairs:
            rates.step_(w.x, full(1.0))
            assert w.push() and rates.push()
        assert [w.client.staleness for w, _ in pairs] == [0, 1]  # B saw exactly A's push
    finally:
        big.close()


def test_counter_map_is_disjoint():
    m = CounterMap(3, extra=2)
    idx = [m.version, m.total, m.reached, m.samples, m.ready, m.started, m.lead]
    idx += [f(r) for f in (m.steps, m.status, m.ident) for r in range(3)]
    idx += [m.extra(k) for k in range(2)]
    assert sorted(idx) == list(range(m.num_counters))


class _Returning(Count):
    """A counter add whose answer is back once ``back`` is set; ``wait`` records that it blocked."""

    def __init__(self, value: int):
        super().__init__(value)
        self.back, self.waited = False, False

    def test(self) -> bool:
        return self.back

    def wait(self) -> int:
        self.waited = self.waited or not self.back
        return self.value


def test_a_steps_counts_are_waited_for_only_beyond_the_steps_in_flight():
    """Counts queued behind an exchange do not hold up the next step: a step's adds are taken in once
    back, and waited for only when COUNTS_IN_FLIGHT steps' are under way; the view of the run's total
    is the newest settled step's."""
    strategy = object.__new__(Membership)
    strategy._counting, strategy._seen = collections.deque(), None
    adds = []
    for step in range(1, COUNTS_IN_FLIGHT + 3):
        strategy.settle(in_flight=COUNTS_IN_FLIGHT - 1)
        step_adds = [_Returning(step - 1), _Returning(10 * step), _Returning(0)]  # steps, total, samples
        adds.append(step_adds)
        strategy._counting.append((step, step_adds))
        if step == 3:
            for count in adds[0]:  # the first step's answers come back while step 3 computes
                count.back = True
    strategy.settle(in_flight=COUNTS_IN_FLIGHT - 1)
    blocked = [i + 1 for i, step_adds in enumerate(adds) if any(c.waited for c in step_adds)]
    assert blocked == [2, 3]  # step 1 came back; steps 2 and 3 were waited for, to keep 8 in flight
    assert len(strategy._counting) == COUNTS_IN_FLIGHT - 1
    assert strategy._seen == (10 * 3 + 1, 3, False)  # the run's total after step 3's add, at step 3
    strategy.settle()  # finish: every step's counts
    assert not strategy._counting and strategy._seen == (
        10 * (COUNTS_IN_FLIGHT + 2) + 1,
        COUNTS_IN_FLIGHT + 2,
        False,
    )
