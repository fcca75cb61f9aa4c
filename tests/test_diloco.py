"""``diloco``: the outer step against torch's Nesterov SGD (tier a), sync diloco == weight-avg and the
asynchronous form surviving a killed worker (tiers b/c), the default digits run (slow).

Must show (issue 12): sync diloco with outer_lr 1, outer_momentum 0, inner_steps 4 and plain SGD equals
weight-avg with period 4 (<= 1e-5); sync and async diloco reach >= 0.95 on the default digits run
(presets digits-diloco and digits-diloco-async); async diloco survives a killed worker.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid

import pytest
import torch

from parambox.box import open_box
from parambox.runtime.world import World
from parambox.strategies.delayed_nesterov import TicketLock
from parambox.strategies.diloco import DelayedNesterov, DilocoOptions, local_steps
from tests.conftest import final_weights, max_abs_diff, run_cli, summary

N = 6  # parameters
FAST = ["--model", "mlp", "--eval-every", "0", "--no-progress", "--threads", "1"]


@pytest.fixture
def box():
    b = open_box("shm", World(), 3 * N, 2, name=f"diloco-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def delayed_nesterov(box, n: int, lr: float = 0.7, momentum: float = 0.9, c: float = 0.0) -> DelayedNesterov:
    return DelayedNesterov(box, N, N, 2 * N, 0, lr, momentum, n, c)


def theta(box) -> torch.Tensor:
    return box.pull(torch.empty(N))


def torch_outer(theta0: torch.Tensor, lr: float = 0.7, momentum: float = 0.9):
    p = torch.nn.Parameter(theta0.clone())
    return p, torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=momentum > 0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_delayed_nesterov_with_n_workers_is_sync_nesterov_on_the_mean(box, k):
    """N = k, c = 0, each block's k pseudo-gradients taken from the same theta: one torch
    SGD(nesterov) step on their mean per block (Liu et al. 2024, Alg. 3 with the paper's buffer)."""
    torch.manual_seed(0)
    theta0 = torch.randn(N)
    box.write(theta0)
    ref, outer = torch_outer(theta0)
    dn = delayed_nesterov(box, k)
    for _ in range(5):
        gs = [torch.randn(N) for _ in range(k)]
        updated = [dn.apply_(g, lambda u, s: box.push(u, s)) for g in gs]
        assert updated == [False] * (k - 1) + [True]
        ref.grad = torch.stack(gs).mean(0)
        outer.step()
        assert torch.allclose(theta(box), ref.detach(), atol=1e-5)


def test_delayed_nesterov_between_updates_moves_by_the_scaled_gradient(box):
    """The arrivals between momentum updates move theta by -lr g / N (+ c beta m with activation)."""
    dn = delayed_nesterov(box, 2, lr=0.5, momentum=0.5, c=0.25)
    box.write(torch.zeros(N))
    dn.apply_(torch.ones(N), lambda u, s: box.push(u, s))  # m = 0: -0.5 * 1/2
    assert torch.allclose(theta(box), torch.full((N,), -0.25))
    dn.apply_(torch.ones(N), lambda u, s: box.push(u, s))  # m = 1; -0.5 (1/2 + (1 - 0.5 + 0.25) 0.5 m)
    assert torch.allclose(theta(box), torch.full((N,), -0.25 - 0.5 * (0.5 + 0.375)))
    assert torch.allclose(box.pull(torch.empty(N), N), torch.ones(N))  # m
    assert torch.allclose(box.pull(torch.empty(N), 2 * N), torch.zeros(N))  # the block's sum was taken
    dn.apply_(torch.zeros(N), lambda u, s: box.push(u, s))  # c beta m = 0.125: -0.5 * 0.125
    assert torch.allclose(theta(box), torch.full((N,), -0.25 - 0.4375 - 0.0625))


def alg3(theta0: torch.Tensor, gs: list[torch.Tensor], n: int, lr: float, beta: float) -> torch.Tensor:
    """Liu et al. 2024, Alg. 3 (Delayed Nesterov, c = 0), the arrivals applied one after another."""
    theta, m, a = theta0.clone(), torch.zeros_like(theta0), torch.zeros_like(theta0)
    for t, g in enumerate(gs):
        a += g / n
        if (t + 1) % n == 0:
            m, a = beta * m + a, torch.zeros_like(a)
            theta -= lr * (beta * m + g / n)
        else:
            theta -= lr * g / n
    return theta


class SlowMomentumRead:
    """The box, but reading the momentum takes ``delay`` s more: the read-modify-write stays open."""

    def __init__(self, box, delay: float):
        self.box, self.delay = box, delay

    def __getattr__(self, name):
        return getattr(self.box, name)

    def pull(self, out, start=0):
        got = self.box.pull(out, start)
        if start == N:  # m
            time.sleep(self.delay)
        return got


class NoTurns(TicketLock):
    """Tickets, but nobody waits for a turn."""

    def acquire(self) -> int:
        return self.box.add_counter(self.ticket, 1)

    def release(self, t: int) -> None:
        self.box.add_counter(self.served, 1)


def _arrive(box, rank: int, n: int, unlocked: bool, out: mp.Queue) -> None:
    """Rank r's two arrivals g = (r + 1) (k + 1) * base; the first of rank 0 holds m open 0.5 s."""
    torch.set_num_threads(1)
    time.sleep(0.15 * rank)  # rank 0 takes ticket 0, the others arrive while it holds m open
    slow = SlowMomentumRead(box, 0.5 if rank == 0 else 0.0)
    dn = DelayedNesterov(slow, N, N, 2 * N, 0, 0.7, 0.9, n)
    if unlocked:  # the protocol before the ticket lock: no turns
        dn.lock = NoTurns(box, 0)
    base = torch.arange(1.0, N + 1)
    for k in range(2):
        g = (rank + 1) * (k + 1) * base
        dn.apply_(g, lambda u, s: box.push(u, s))
        slow.delay = 0.0
        out.put((dn.last_ticket, g.tolist()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,unlocked", [(1, False), (2, False), (1, True)])
def test_async_outer_steps_of_several_processes_follow_alg3(box, n, unlocked):
    """Three processes, two arrivals each, buffer_size 1 or 2 (several blocks close while another is
    open), rank 0 holding the momentum's read-modify-write open 0.5 s while the others arrive:
    theta is Alg. 3 applied in ticket order. Without the turns two closers read the same m and
    theta misses Alg. 3 (the issue found 0.534 where Alg. 3 gives 0.171)."""
    theta0 = torch.linspace(-1.0, 1.0, N)
    box.write(theta0)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_arrive, args=(box, r, n, unlocked, out)) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=30) for _ in range(6))
    for p in procs:
        p.join(10)
    assert [t for t, _ in got] == list(range(6))
    expected = alg3(theta0, [torch.tensor(g) for _, g in got], n, 0.7, 0.9)
    if unlocked:
        assert not torch.allclose(theta(box), expected, atol=1e-3)
    else:
        assert torch.allclose(theta(box), expected, atol=1e-4), (theta(box), expected)
        assert box.read_counter(1) == 6  # every turn served


STALL_S = 0.3


@pytest.fixture
def lock_box():
    b = open_box("shm", World(), 1, 5, name=f"lock-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def lock_of(box, rank: int) -> TicketLock:
    # counters: 0 ticket, 1 served, 2.. the slots of 3 ranks
    return TicketLock(box, 0, 1, 2, rank, 3, STALL_S)


def test_a_turn_whose_holder_died_and_a_ticket_abandoned_in_the_queue_are_passed_over(lock_box):
    """Rank 0 takes the turn and dies holding it (its replacement clears its slot); rank 1 takes the
    next ticket and dies waiting (abandoned). Rank 2, third in line, passes both over (after 2 x
    stall_s: one live-looking ticket before its own), and the turns go on one by one after it."""
    assert lock_of(lock_box, 0).acquire() == 0
    assert lock_of(lock_box, 1).take() == 1  # rank 1 dies before its turn
    lock_of(lock_box, 0)  # rank 0's replacement starts: its predecessor's ticket 0 is abandoned
    third = lock_of(lock_box, 2)
    t0 = time.monotonic()
    assert third.acquire() == 2
    waited = time.monotonic() - t0
    assert 2 * STALL_S < waited < 2 * STALL_S + 1.0, waited
    assert third.passed_over == 2 and lock_box.read_counter(1) == 2
    third.release(2)
    assert lock_box.read_counter(1) == 3 and lock_box.read_counter(2 + 2) == 0
    assert lock_of(lock_box, 1).acquire() == 3  # no wait: its turn


def test_a_holder_stalled_past_the_timeout_is_passed_over_and_fenced_when_it_wakes(lock_box):
    """Rank 0 holds the turn and stalls (a SIGSTOP); rank 1 passes it over after stall_s and takes
    its turn. When rank 0 wakes, its release adds nothing: rank 1 holds the turn, and rank 2 is next."""
    stalled = lock_of(lock_box, 0)
    assert stalled.acquire() == 0
    second = lock_of(lock_box, 1)
    assert second.acquire() == 1 and second.passed_over == 1
    stalled.release(0)  # wakes: fenced
    assert lock_box.read_counter(1) == 1  # still rank 1's turn
    got = []
    th = threading.Thread(target=lambda: got.append(lock_of(lock_box, 2).acquire()))
    th.start()
    time.sleep(0.1)
    assert not got  # waits for rank 1
    second.release(1)
    th.join(5)
    assert got == [2]


def test_a_waiter_stalled_past_its_turn_gets_none_and_moves_nothing(lock_box):
    """A waiter whose turn was passed over while it was stalled (its own ticket too) learns so on
    waking: ``acquire`` returns None, and the turn stays with the one who took it."""
    assert lock_of(lock_box, 0).acquire() == 0  # rank 0 dies holding the turn
    late = lock_of(lock_box, 1)
    assert late.take() == 1  # and stalls before its wait
    third = lock_of(lock_box, 2)
    assert third.acquire() == 2  # passes over turn 0 (dead) and 1 (stalled): 2 x stall_s
    assert late.wait(1) is None  # wakes
    assert lock_box.read_counter(1) == 2 and lock_box.read_counter(2 + 1) == 0


def test_dylu_local_steps_follow_the_speed():
    assert local_steps(0.02, [0.01, 0.04], 20) == 10  # half the fastest's speed: half its steps
    assert local_steps(0.01, [0.02, 0.03], 20) == 20  # the fastest does H
    assert local_steps(1.0, [0.001], 20) == 1  # never fewer than one
    assert local_steps(0.01, [0.0], 20) == 20  # a worker without a measured speed yet is ignored
    # two equal workers, one measured a little slower: both run H (the floor gave the slower H - 1,
    # one exchange more every H rounds); further off, the nearest whole step (14.8: 15, not 14)
    assert local_steps(0.0104, [0.01], 16) == 16 and local_steps(0.01, [0.0104], 16) == 16
    assert local_steps(0.0135, [0.01], 20) == 15


def test_options_are_checked():
    with pytest.raises(ValueError, match="momentum_activation"):
        DilocoOptions(buffer_size=4, momentum_activation=0.5)
    with pytest.raises(ValueError):
        DilocoOptions(outer_momentum=1.0)


SGD = ["--optimizer", "sgd", "--momentum", "0", "--lr", "0.1", "--workers", "2", "--batch-size", "16"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_diloco_with_lr_1_and_no_momentum_is_weight_avg(tmp_path):
    """Closed form: theta - 1 * (theta - mean theta_i) = mean theta_i; 22 steps also check the last
    partial round (weight-avg averages at the end, diloco takes an outer step)."""
    runs = {}
    for strategy, opts in [
        ("weight-avg", ["weight-avg.period=4"]),
        ("diloco", ["diloco.inner_steps=4", "diloco.outer_lr=1.0", "diloco.outer_momentum=0.0"]),
    ]:
        out = tmp_path / strategy
        sets = [a for o in opts for a in ("--set", o)]
        run_cli("train", "--strategy", strategy, *sets, *SGD, "--steps", "22", "--out", str(out), *FAST)
        runs[strategy] = final_weights(out)
    assert max_abs_diff(runs["diloco"], runs["weight-avg"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_async_diloco_survives_a_killed_worker(tmp_path):
    out = tmp_path / "run"
    sets = ["--set", "diloco.asynchronous=true", "--set", "diloco.inner_steps=10"]
    args = ["train", "--strategy", "diloco", *sets, "--steps", "200", "--out", str(out), *FAST]
    proc = run_cli(*args, env={"PARAMBOX_FAULT": "1:60:kill"})
    assert "lost worker ranks [1]" in proc.stderr
    s = summary(out)
    assert s["lost_workers"] == [1] and s["worker_steps"] == [200, 60]
    assert s["final_test_accuracy"] >= 0.8
    assert all(torch.isfinite(w).all() for w in final_weights(out).values())


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("preset", ["digits-diloco", "digits-diloco-async"])
def test_default_digits_run_reaches_095(preset, tmp_path):
    """The presets: AdamW lr 1e-3, inner_steps 10, outer lr 0.7 (momentum 0.9; async 0.5), 600 steps,
    2 workers. Measured: sync 0.958-0.972 over seeds; async 0.967-0.972 at seeds 0-3."""
    out = tmp_path / "run"
    run_cli("train", "--preset", preset, "--eval-every", "0", "--out", str(out), "--no-progress")
    s = summary(out)
    assert s["final_test_accuracy"] >= 0.95, s["final_test_accuracy"]
    assert s["config"]["optimizer"] == "adamw"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_async_diloco_replaces_a_killed_worker_with_max_restarts(tmp_path):
    """The replacement pulls theta, starts a fresh round and does the steps its predecessor had not."""
    out = tmp_path / "run"
    sets = ["--set", "diloco.asynchronous=true", "--set", "diloco.inner_steps=10", "--max-restarts", "1"]
    args = ["train", "--strategy", "diloco", *sets, "--steps", "200", "--out", str(out), *FAST]
    run_cli(*args, env={"PARAMBOX_FAULT": "1:60:kill"})
    s = summary(out)
    assert (s["restarts"], s["lost_workers"], s["worker_steps"]) == (1, [], [200, 200])
    assert s["final_test_accuracy"] >= 0.8
