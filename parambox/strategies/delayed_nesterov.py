"""The outer step of asynchronous DiLoCo (Delayed Nesterov) and DyLU's local steps (Liu et al. 2024).

See ``parambox/strategies/diloco.py`` for the strategy that uses them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from parambox.runtime.control import WorkerBoard


class DelayedNesterov:
    """The outer step of asynchronous DiLoCo on the box: Delayed Nesterov (Liu et al. 2024, Alg. 3).

    The box holds ``theta`` (at ``0``), the momentum ``m`` (at ``m_start``) and the block accumulator
    ``a`` (at ``a_start``, the block's pseudo-gradients scaled ``1/N``), the ticket counter and the
    ``served`` counter after it. For one arrival ``g`` (``apply_``), atomic as a whole::

        t <- ticket++;  wait until served == t
        a += g / N
        if (t + 1) % N == 0:  a_blk <- a; a <- 0; m <- beta m + a_blk
                              theta -= lr ((1 - c N + c) beta m + g / N)
        else:                 theta -= lr (c beta m + g / N)
        served++

    With ``c = 0`` and the ``N`` pseudo-gradients of a block all taken from the same ``theta``, a block
    is one synchronous Nesterov step on their mean.

    On a box that applies the step itself (``box.fuses_outer_step``: the rma box's memory server), the
    holder of the turn sends ``g`` with the coefficients and gets theta back (``outer_step`` of
    ``apply_``), and ``m`` and ``a`` live beside theta on its servers: one trip of the model each way,
    instead of the block's accumulator and momentum pulled and written back by a worker.

    >>> dn = DelayedNesterov(box, numel=4, m_start=4, a_start=8, ticket=0, lr=0.7, momentum=0.9, n=2)  # doctest: +SKIP
    >>> dn.apply_(g, push_theta=lambda u, scale: box.push(u, scale))  # doctest: +SKIP
    """

    def __init__(
        self,
        box: Any,
        numel: int,
        m_start: int,
        a_start: int,
        ticket: int,
        lr: float,
        momentum: float,
        n: int,
        activation: float = 0.0,
        lock: TicketLock | None = None,
    ):
        self.box, self.numel, self.m_start, self.a_start = box, numel, m_start, a_start
        self.lock = lock or TicketLock(box, ticket)
        self.lr, self.beta, self.n, self.c = lr, momentum, n, activation
        self._m = torch.empty(numel)
        self._a = torch.empty(numel)
        self.last_ticket = -1

    @property
    def fused(self) -> bool:
        return getattr(self.box, "fuses_outer_step", False)

    def coefficients(self) -> tuple[float, float, float, float, float]:
        """``(lr, beta, 1 / N, k, k_last)`` of the box's fused step: theta moves by ``-lr (k m + g / N)``,
        at a block's last arrival ``-lr (k_last m + g / N)`` with the new ``m``."""
        n, c, beta = self.n, self.c, self.beta
        return (self.lr, beta, 1.0 / n, c * beta, (1 - c * n + c) * beta)

    def apply_(self, g: torch.Tensor, push_theta: Any, outer_step: Any = None, weight: float = 1.0) -> bool:
        """One arrival (``weight``: unused, every arrival weighs ``1 / N``); returns whether this arrival
        updated the momentum (it held a block's last ticket).
        ``push_theta(u, scale)`` pushes theta's update; where the box fuses the step, ``outer_step(g,
        coefficients, last)`` is called instead (given: the caller brings the new theta back with it)."""
        n, beta = self.n, self.beta
        if beta == 0:  # no momentum: every arrival is its own step, scaled 1/N
            push_theta(g, -self.lr / n)
            return False
        t = self.last_ticket = self.lock.acquire()
        if t is None:  # stalled past the lock's patience: the turn went on without this arrival
            return False
        try:
            if outer_step is not None and self.fused:
                last = (t + 1) % n == 0
                outer_step(g, self.coefficients(), last)
                return last
            return self._step(t, g, push_theta)
        finally:
            self.lock.release(t)

    def state(self) -> torch.Tensor:
        """``[m | a]`` as the box holds them now (for a checkpoint)."""
        if self.fused:
            out = torch.empty(2 * self.numel)
            self.box.pull_companion(out[: self.numel], 0)
            self.box.pull_companion(out[self.numel :], 1)
            return out
        return torch.cat([self.box.pull(torch.empty(self.numel), s) for s in (self.m_start, self.a_start)])

    def load_state(self, state: torch.Tensor) -> None:
        """Put ``[m | a]`` back (before anyone pushes)."""
        m, a = state[: self.numel], state[self.numel :]
        if self.fused:
            self.box.write_companion(m, 0)
            self.box.write_companion(a, 1)
        else:
            self.box.write(m, self.m_start)
            self.box.write(a, self.a_start)

    def _step(self, t: int, g: torch.Tensor, push_theta: Any) -> bool:
        """Arrival ``t``'s outer step; the caller holds the turn."""
        n, beta = self.n, self.beta
        update = g / n
        if (t + 1) % n == 0:
            a = self.box.pull(self._a, self.a_start) + g / n  # the block's N arrivals, this one last
            self.box.write(torch.zeros_like(a), self.a_start)
            m = self.box.pull(self._m, self.m_start)
            new_m = m * beta + a
            self.box.write(new_m, self.m_start)
            update.add_(new_m, alpha=(1 - self.c * n + self.c) * beta)
            push_theta(update, -self.lr)
            return True
        self.box.push(g, 1.0 / n, self.a_start)
        if self.c > 0:
            update.add_(self.box.pull(self._m, self.m_start), alpha=self.c * beta)
        push_theta(update, -self.lr)
        return False


QUORUM_FLAG = 2  # ``last`` of the fused outer step with this bit set: the quorum rule (``box/server.py``)
QUORUM_COUNTERS = 4  # steps applied, workers pending, samples pending, first arrival (us); then one per rank


class QuorumNesterov:
    """The outer step of asynchronous DiLoCo with a quorum (Decoupled DiLoCo, Google DeepMind 2026).

    Arrivals accumulate at the synchroniser (the box) until ``quorum`` distinct workers have arrived
    since the last step, or an arrival comes ``grace_s`` or more after the pending step's first one;
    that arrival applies ONE outer Nesterov step on the sample-weighted mean of the pending arrivals::

        a <- a + (w / (W + w)) (g - a);  W <- W + w          (a: the weighted mean so far)
        if closing:  m <- beta m + a;  theta -= lr (a + beta m);  a <- 0;  W <- 0

    (``torch.optim.SGD(nesterov=True)`` with ``theta.grad = a``.) An arrival that does not close a step
    leaves theta as it is and gets it back at once: a worker never waits for the quorum, and goes on from
    the center as of its push (its own contribution still pending). A worker that arrives twice before
    the step counts once towards the quorum (both arrivals weigh in). The grace window is checked at
    arrivals: it bounds how long a step waits when fewer than ``quorum`` workers are alive. Where ``live``
    counts the workers still in the run (not done, lost or halted), the quorum is at most that count: the
    last worker's last push (weight 0 if it has no round left) closes the step, so nothing pushed is left
    pending at the end.

    Arrivals take turns in ticket order (``TicketLock``), as Delayed Nesterov's. The quorum's counters
    (``base``: steps applied, workers pending, samples pending ``W``, the first arrival's time in us; then
    rank ``r``'s last step joined + 1 at ``base + 4 + r``) are updated after the arrival's step landed, so
    a worker that dies before that loses only its own arrival. On a box that applies the step itself (the
    memory server, ``fuses_outer_step``) the arrival commits whole, per shard; one that dies in the few
    counter updates after the commit leaves the next step's weights off (still a convex mean).

    >>> q = QuorumNesterov(box, 4, 4, 8, lock, base=2, lr=0.7, momentum=0.9, quorum=3, rank=0)  # doctest: +SKIP
    >>> q.apply_(g, push_theta=lambda u, scale: box.push(u, scale), weight=320)  # doctest: +SKIP
    """

    def __init__(
        self,
        box: Any,
        numel: int,
        m_start: int,
        a_start: int,
        lock: TicketLock,
        base: int,
        lr: float,
        momentum: float,
        quorum: int,
        rank: int,
        grace_s: float | None = None,
        clock: Any = time.time,
        live: Any = None,
    ):
        self.box, self.numel, self.m_start, self.a_start, self.lock = box, numel, m_start, a_start, lock
        self.base, self.lr, self.beta, self.quorum, self.rank = base, lr, momentum, quorum, rank
        self.grace_s, self.clock = grace_s, clock
        self.live = live  # () -> the workers still in the run (a quorum above that count waits for them)
        self._m = torch.empty(numel)
        self._a = torch.empty(numel)
        self.last_ticket = -1
        self.steps_applied = 0  # by this worker's arrivals

    fused = DelayedNesterov.fused
    state = DelayedNesterov.state
    load_state = DelayedNesterov.load_state

    def apply_(self, g: torch.Tensor, push_theta: Any, outer_step: Any = None, weight: float = 1.0) -> bool:
        """One arrival of weight ``weight`` (its samples); returns whether it applied the outer step.
        ``push_theta(u, scale)`` pushes theta's update (and pulls the new theta); not called for an arrival
        that closes no step (the caller pulls theta). Where the box fuses the step, ``outer_step(g,
        coefficients, flags)`` is called instead and brings theta back. An arrival of weight 0 (a worker's
        last push without a round of its own) adds nothing to the mean but may close the step; with
        nothing pending it does nothing."""
        t = self.last_ticket = self.lock.acquire()
        if t is None:  # stalled past the lock's patience: the turn went on without this arrival
            return False
        try:
            box, b = self.box, self.base
            step, count, total, first, joined = (
                h.wait()
                for h in [box.add_counter_async(i, 0) for i in (b, b + 1, b + 2, b + 3, b + 4 + self.rank)]
            )
            if total + weight <= 0:  # an arrival without samples, and nothing pending
                return False
            new = joined != step + 1
            now = int(self.clock() * 1e6)
            late = self.grace_s is not None and first > 0 and now - first >= self.grace_s * 1e6
            quorum = self.quorum if self.live is None else min(self.quorum, max(1, self.live()))
            close = count + new >= quorum or late
            share = weight / (total + weight)
            if outer_step is not None and self.fused:
                outer_step(g, (self.lr, self.beta, share, 0.0, 0.0), QUORUM_FLAG | int(close))
            else:
                self._step(g, share, close, push_theta)
            if close:  # the next step starts empty
                for i, v in ((b + 1, -count), (b + 2, -total), (b + 3, -first), (b, 1)):
                    box.add_counter(i, v)
                self.steps_applied += 1
            else:
                box.add_counter(b + 1, int(new))
                box.add_counter(b + 2, int(weight))
                if first == 0:
                    box.add_counter(b + 3, now)
                box.add_counter(b + 4 + self.rank, step + 1 - joined)
            return close
        finally:
            self.lock.release(t)

    def _step(self, g: torch.Tensor, share: float, close: bool, push_theta: Any) -> None:
        """The arrival's step, applied by this worker with box operations (the caller holds the turn)."""
        a = self.box.pull(self._a, self.a_start)
        a.add_(g - a, alpha=share)
        if not close:
            self.box.write(a, self.a_start)
            return
        m = self.box.pull(self._m, self.m_start).mul_(self.beta).add_(a)
        self.box.write(m, self.m_start)
        self.box.write(torch.zeros_like(a), self.a_start)
        push_theta(a.add_(m, alpha=self.beta), -self.lr)

    def counters(self, ranks: int) -> list[int]:
        """The pending step's counters (for a checkpoint; the first arrival's time as 0: the grace window
        starts again at the next arrival after a resume)."""
        got = [self.box.read_counter(self.base + i) for i in range(QUORUM_COUNTERS + ranks)]
        got[3] = 0
        return got

    def load_counters(self, values: list[int]) -> None:
        for i, v in enumerate(values):
            self.box.set_counter(self.base + i, int(v))


class TicketLock:
    """Turns in ticket order over box counters, for processes that may die or stall holding one.

    ``ticket`` (fetch-and-add: an arrival's number ``t``) and ``served`` (the turn now: ``t`` goes when
    ``served == t``, and adds one when done) are a ticket lock. A holder that is SIGKILLed, or that
    stalls past ``stall_s`` (``--timeout``: treated as dead), would stop every later turn, and a waiter
    that gave up would leave its ticket in the queue for ever. So each rank's slot (``holders + r``)
    says which ticket it holds (``t + 1``, 0 for none), and a turn that stood still is passed over by
    the waiters, staggered: the one with ``k`` live-looking tickets between the turn and its own waits
    ``(k + 1) stall_s``, then moves ``served`` on to its own ticket (past the stuck turn and any
    abandoned ones). So the first waiter in line does it, or the next if that one stalled too. A turn
    whose holder is known dead (the local launcher's board, ``WorkerBoard``, or MPI's failed ranks) is
    passed over at once, by the waiter whose tickets before its own are all dead ranks'.

    A holder that wakes after being passed over is fenced at its ends: ``acquire`` returns None when
    its turn went by, and ``release`` adds nothing when ``served`` moved on. A holder stalled in the
    middle of its turn can still write beside the next holder once (that arrival's step is then not
    atomic); nothing else is lost.

    >>> lock = TicketLock(box, ticket=0, served=1, holders=2, rank=0, ranks=2, stall_s=10)  # doctest: +SKIP
    >>> t = lock.acquire()                         # doctest: +SKIP
    >>> ...; lock.release(t)                       # doctest: +SKIP
    """

    def __init__(
        self,
        box: Any,
        ticket: int,
        served: int | None = None,
        holders: int | None = None,
        rank: int = 0,
        ranks: int = 0,
        stall_s: float = 300.0,
        board: WorkerBoard | None = None,
    ):
        self.box, self.ticket, self.rank, self.ranks, self.stall_s = box, ticket, rank, ranks, stall_s
        self.board = board if board is not None else WorkerBoard.from_env()
        self.served = ticket + 1 if served is None else served
        self.holders = holders
        self.passed_over = 0  # turns this rank moved on from a holder that died or stalled
        self.clear()

    def clear(self) -> None:
        """This rank holds no ticket (a replacement's start: its predecessor's ticket is abandoned)."""
        if self.holders is not None:
            self.box.set_counter(self.holders + self.rank, 0)

    def reset(self, to: int) -> None:
        """Ticket and turn both ``to``, nobody holding one (a restore from a checkpoint, by one rank)."""
        self.box.set_counter(self.ticket, to)
        self.box.set_counter(self.served, to)
        for r in range(self.ranks if self.holders is not None else 0):
            self.box.set_counter(self.holders + r, 0)

    def acquire(self) -> int | None:
        """Take a ticket and wait for its turn: the ticket, or None if the turn was passed over meanwhile."""
        return self.wait(self.take())

    def take(self) -> int:
        t = self.box.add_counter(self.ticket, 1)
        if self.holders is not None:
            self.box.set_counter(self.holders + self.rank, t + 1)
        return t

    def wait(self, t: int) -> int | None:
        last, since = self.box.read_counter(self.served), time.monotonic()
        checked = since
        while (now := self.box.read_counter(self.served)) < t:
            clock = time.monotonic()
            if now != last:
                last, since = now, clock
                continue
            stood = clock - since > self.stall_s and clock - since > self.stall_s * (1 + self._ahead(now, t))
            dead = False
            if not stood and clock - checked > _DEAD_CHECK_S:
                checked, dead = clock, self._dead_before(now, t)
            if stood or dead:
                self.box.add_counter(self.served, t - now)  # pass over turns now..t-1
                self.passed_over += t - now
                break
            time.sleep(1e-4)
        if self.box.read_counter(self.served) != t:  # stalled while waiting: the turn went by
            self.clear()
            return None
        return t

    def release(self, t: int) -> None:
        if self.box.read_counter(self.served) == t:  # else passed over while holding it: fenced
            self.box.add_counter(self.served, 1)
        self.clear()

    def _dead_before(self, now: int, t: int) -> bool:
        """The turn's holder is known dead, and so is every other holder of a ticket before ``t``."""
        if self.holders is None:
            return False
        dead = set(self.board.dead_ranks() if self.board is not None else ())
        dead.update(self.box.failed_ranks())
        if not dead:
            return False
        held = {r: self.box.read_counter(self.holders + r) - 1 for r in range(self.ranks) if r != self.rank}
        if not any(h == now and r in dead for r, h in held.items()):
            return False
        return all(r in dead for r, h in held.items() if now <= h < t)

    def _ahead(self, now: int, t: int) -> int:
        """Tickets others hold between the stuck turn and ``t`` (the waiters in line before this one)."""
        if self.holders is None:
            return 0
        held = (self.box.read_counter(self.holders + r) - 1 for r in range(self.ranks) if r != self.rank)
        return sum(now < h < t for h in held)


def local_steps(own_s: float, others_s: list[float], inner_steps: int) -> int:
    """DyLU (Liu et al. 2024, Eq. 6): ``v_w / max v * H`` steps, at least 1, from seconds per step.

    Eq. 6 takes the floor; here it is rounded to the nearest and held at ``H`` while this worker is
    within ``SAME_SPEED`` of the fastest. Speeds are measured, so of two equal workers one is always a
    little slower: under the floor it ran ``H - 1``-step rounds, and exchanged more often than the rule
    needs.

    >>> local_steps(0.02, [0.01], 20), local_steps(0.01, [0.02], 20), local_steps(0.5, [0.01], 20)
    (10, 20, 1)
    >>> local_steps(0.0103, [0.01], 16), local_steps(0.014, [0.01], 16)  # 3 % slower: H; 29 %: 11.4
    (16, 11)
    """
    fastest = min([own_s, *[s for s in others_s if s > 0]])
    if own_s <= 0 or fastest / own_s >= 1 - SAME_SPEED:
        return inner_steps
    return max(1, round(fastest / own_s * inner_steps))


_DEAD_CHECK_S = 0.05  # how often a waiter reads who is dead (the board, MPI's failed ranks)
SAME_SPEED = 0.05  # DyLU holds H for a worker this close to the fastest (a fraction of its speed)
