"""``dogwild``: a master applies each gradient as it arrives and shares the new weights with every worker.

The message-passing counterpart of the box strategies (Dogwild: distributed Hogwild by messages), as
the survey describes it: "the master process updates the global weights whenever it receives
gradients from the slave processes concurrently, and shares the updated weights with all the slave
processes at once. Each slave process updates the most recently received weights with the gradients
which is explored by itself, and sends the gradients to the master."

Rank 0 is the master and trains too, so ``--workers N`` gives N processes computing gradients (the
default digits run with 2 workers has two). The weights ``w`` and the one optimizer that applies
every gradient live on rank 0; every process computes on a replica ``x``.

A worker's step: adopt the newest weights received so far (if newer than ``x``: no wait), compute
``g`` on ``x``, ``isend`` it to rank 0 (two-sided torch.distributed point-to-point over gloo), apply
it to ``x`` itself with an optimizer of its own (the survey's "each slave process updates the most
recently received weights with the gradients which is explored by itself") and go on. There is no
per-step wait for weights: a thread of its own receives the broadcasts into two buffers (one being
filled, the newest complete one), and ``begin_step`` copies the newest into ``x`` and adds back this
worker's own updates that those weights do not hold yet (each broadcast says how many of the
worker's gradients rank 0 has taken), so adopting the master's weights never drops a worker's own
step. Staleness is bounded as in stale synchronous parallel (``max_ahead``, default 1): before its
step ``c`` a worker, and rank 0 as well, waits until the weights it holds contain every rank's
gradients up to ``c - max_ahead`` (each broadcast carries how many gradients of every rank the
weights hold; a rank that is done, halted or lost no longer counts), so no rank runs more than
``max_ahead`` steps ahead of the slowest one, and a gradient applied late misses a bounded number of
updates; ``max_ahead=none`` never waits. Gradients
go out from two alternating message buffers (backward accumulates straight into them), so a send
overlaps the next step's computation; a worker waits only when rank 0 has not yet taken the
gradient it sent two steps ago (back-pressure, which bounds staleness when the master falls behind).

Rank 0 serves in threads. One per worker blocks in ``irecv(src=r)`` (gloo cannot poll a pending
receive, and a receive from any source fails with any one peer's reset, so a dead worker would take
the others down with it) and applies each gradient with the optimizer (``optimizer.step()`` on ``w``,
the version goes up). One sender per worker shares the weights: whenever the version moved, it copies
``w`` (under the lock) and sends it, with the version and the staleness of that worker's last
applied gradient. Updates that land while a send is in flight are coalesced: the next send carries
the newest weights, so a slow link or a slow worker gets fewer, fresher messages and never a queue.
Rank 0's main thread applies its own gradient the same way between its forward/backward passes and
refreshes its replica; a lock keeps the threads from stepping the optimizer together. The replica
is not ``w`` itself, so a gradient applied mid-backward never invalidates autograd's saved tensors.
Optimizer state (momentum) exists once, on rank 0.

Termination: every process does its steps. A worker's last message is ``FINAL``; in ``finish`` rank 0
waits until each worker has sent it, has halted, or is lost: silent for ``lost_after_s`` (default
``--timeout``), its process gone (same host), or a send to it failed. Then it sends the final
weights to every worker that is still there, so every replica ends equal to the result; a worker's
``finish`` waits for them (up to ``--timeout``). A worker whose loss or gradient is not finite sends
``HALT`` instead of the gradient and leaves the run; rank 0 checks every gradient again before
applying it, so ``w`` stays finite.

The master's death (failover): the master's weights live on in every replica, each the weights it
last adopted plus its own steps since. Where a worker finds the master dead (the local launcher's
board, or its process gone from this host), the survivors check in on a ``FileStore`` of the run (in
the temporary directory, named by a token rank 0 drew at start-up); the first to check in waits for
every live worker (``lost_after_s`` at most) and names the members, and the lowest-ranked member
becomes the master: its replica (with the newest weights it had received) is ``w``, its own optimizer's
state the master's, and it meets each member over a pair group. Each member goes on with its step and
gradient counts; what it sent that the new ``w`` does not hold (at most the weights' lag and the sends
in flight, ``max_ahead`` + 2 gradients a worker) is lost, from ``w`` and from its replica alike; the
gradient of a step whose send failed goes again, to the new master (or into ``w``, on it). The new
master leads: it writes the checkpoints,
``metrics.jsonl`` and the result. ``applied_gradients`` in the summary counts, per rank, the gradients
the result holds.

Replacements (``--max-restarts``, local launcher), the master's too: a new process of a lost rank
cannot join the run's process group, so it meets the master of the moment over a gloo pair group of
its own (its life's keys in a file of the run's temporary folder, which the master watches), takes the
dead rank's step and gradient counts, waits for the newest weights and carries on as a worker; the
master waits for a replacement under way (up to ``lost_after_s``) before it ends, and the rank is not
listed lost. Its gradient count is treated as caught up with the others' for the staleness bound (it
starts from the newest weights). Rank 0's replacement so joins the survivor that took over from it.

Messages (float32, host memory): ``[gradient | kind, version used, loss, samples, steps done]``;
broadcasts ``[weights | version, staleness, final, gradients taken from this worker, then per rank
the gradients taken (inf: done, halted or lost: the staleness bound's count), then per rank the
gradients the weights hold (fewer after a failover)]``. They travel over gloo also when the run's
backend is nccl (a gloo group of their own: NCCL has no receive-from-any); GPU gradients and weights
are staged through the host buffers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import tempfile
import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from parambox.box import Layout
from parambox.errors import CommTimeout, warn
from parambox.numerics import is_finite
from parambox.runtime import dist as pbdist
from parambox.runtime.control import DEAD, EXITED, WorkerBoard, current_life, rejoining
from parambox.runtime.spawn import identity_gone, process_identity
from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value
from parambox.strategies.grads import GradViews

GRAD, FINAL, HALT = 0.0, 1.0, 2.0  # message kinds (the first element after the gradient)
HEADER, BCAST_HEADER = 5, 4
_POLL_S = 0.05
_FOREVER = timedelta(days=365)  # a worker's broadcast receiver: rank 0 may rightly stay quiet for long


class DogwildOptions(Options):
    lost_after_s: float | None = Field(
        None, gt=0, description="a worker silent this long is lost (default: --timeout)"
    )
    max_ahead: int | None = Field(
        1,
        ge=0,
        description=(
            "before its step c a rank waits until the weights it has hold every rank's gradients up "
            "to c - max_ahead (stale synchronous parallel); none: it never waits"
        ),
    )


class Dogwild(Strategy):
    """Rank 0 applies gradients as they come and shares the weights with all; the others send gradients.

    >>> # parambox train --strategy dogwild --workers 3   (rank 0 + 2 workers, all computing)
    """

    name = "dogwild"
    copies_the_weights = True  # the master's weights
    shared_center = True
    comm_topology = "ps"  # every gradient into rank 0, the weights out of it to every worker
    Options = DogwildOptions
    tolerates_worker_loss = True
    # The master's death is survived: the lowest-ranked survivor becomes the master (failover), and with
    # restarts left a replacement of rank 0 joins it as a worker
    tolerates_rank0_loss = True
    lockstep = False  # workers step on their newest weights, never waiting for each other
    # It starts the process group itself: a replacement (--max-restarts) cannot join the run's, and
    # talks to rank 0 over a pair group of its own instead.
    needs_process_group = False
    # Rank 0's one optimizer takes every worker's gradient as a step of its own, stale, with momentum: at
    # the run's default rate 0.03, 6 of 12 digits runs ended at 0.62-0.93 (seed 3: 0.20); at half, seed 9
    # of 10 still ended at 0.933; at a third, seeds 0-9 reached 0.955-0.978 (two runs of each).
    default_optimizer = {"lr": 0.01}

    def __init__(self, ctx: Context, options: DogwildOptions):
        super().__init__(ctx, options)
        if ctx.box.needs_mpi:
            warnings.warn("dogwild sends messages and uses no box: --box rma is ignored", stacklevel=2)
        self.layout = Layout.from_model(self.model)
        self.params = list(self.model.parameters())
        self.x = torch.empty(self.layout.numel, device=self.world.device)
        self.layout.bind_params_(self.model, self.x, copy_values=True)
        self.lost_after_s = options.lost_after_s or ctx.timeout_s
        self.halted = False
        self.staleness = 0.0
        self.start_step: int | None = None  # a replacement's first step
        self.lead = 0  # the master's rank: 0, or after its death the survivor that took over (failover)
        self.failovers = 0
        self.board = WorkerBoard.from_env()
        self.failover_store: Any = None  # the new master's: removed at close
        if rejoining():  # a replacement (rank 0's too): it meets the master of the moment
            self.pg = None
            self.peer = _rejoin(self)
            return
        pbdist.init_distributed(self.world, ctx.timeout_s)
        with self.collective("dogwild start-up"):
            self.pg = _message_group(self.world.world_size)
            self.idents, self.token = _identities(self.world.world_size, self.pg)
        if self.world.rank == 0:
            self.master = _Master(self, self.idents)
        else:
            self.peer = _Peer(self, self.idents[0], _Link(0, self.pg))

    @property
    def is_master(self) -> bool:
        return self.world.rank == self.lead

    @property
    def leads(self) -> bool:
        """The master holds the run's result: rank 0, or the survivor that took over from it."""
        return self.is_master

    # -- failover: the master died, a survivor takes over ---------------------------------------------
    def _as_peer(self, fn, *args) -> bool:
        """``fn(*args)`` on this worker's peer; False where the master died during it and this rank
        went through the failover instead (the caller then does ``fn``'s work again in its new role)."""
        try:
            if self.peer.error is None or not self._master_dead():
                fn(*args)
                return True
        except (CommTimeout, RuntimeError) as e:
            if not self._master_dead():
                raise
            error: BaseException = e
        else:
            error = CommTimeout(f"dogwild: rank {self.lead} stopped sending weights ({self.peer.error})")
        self._take_over(error)
        return False

    def _master_dead(self, wait_s: float = 2.0) -> bool:
        """The master's process is dead: the local launcher's board says so, or it is gone from this
        host (waited for ``wait_s``, the launcher's notice of a death)."""
        if getattr(self, "idents", None) is None:
            return False  # (a replacement that could not learn the ranks' identities)
        deadline = time.monotonic() + wait_s
        while True:
            if (self.board is not None and self.board.dead(self.lead)) or identity_gone(
                self.idents[self.lead]
            ):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)

    def _alive(self, r: int) -> bool:
        if self.board is not None and self.board.state(r) in (DEAD, EXITED):
            return False
        return not identity_gone(self.idents[r])

    def _take_over(self, error: BaseException) -> None:
        """The failover (see the module docstring): the survivors agree on the members, the lowest
        ranked becomes the master, the others meet it."""
        old, me, peer, timeout_s = self.lead, self.world.rank, self.peer, self.ctx.timeout_s
        self.failovers += 1
        try:
            store = _failover_store(self.token, self.failovers, timeout_s)
        except (OSError, RuntimeError):
            raise error from None
        peer._adopt()  # the newest weights received: the fewest gradients lost
        mine = {"sent": peer.sent, "steps": peer.steps, "samples": peer.samples, "life": current_life()}
        # what this rank's replica holds of each rank's gradients: the adopted weights', and its own
        # steps since (the pending ones, re-added on adoption)
        mine["held"] = [*peer.held[:me], int(peer.held[me]) + len(peer.pending), *peer.held[me + 1 :]]
        store.set(f"in/{me}", json.dumps(mine))
        if store.add("ticket", 1) == 1:
            self._decide(store, old)
        try:
            store.wait(["members"], timedelta(seconds=self.lost_after_s + timeout_s))
        except RuntimeError:
            raise CommTimeout(
                f"dogwild: rank {old}, the master, died, and no survivor named the members"
            ) from None
        members = json.loads(store.get("members"))
        if me not in members:
            raise CommTimeout(
                f"dogwild: rank {old}, the master, died, and the survivors went on without rank {me}"
            )
        counts = {r: json.loads(store.get(f"in/{r}")) for r in members}
        self.lead = min(members)
        with self.collective("dogwild failover"):
            if me == self.lead:
                links = {r: _Link(1, pair=_pair(store, r, 0, 0, timeout_s)) for r in members if r != me}
                self.master = _Master(self, self.idents, links=links, counts=counts)
                self.master.optimizer.load_state_dict(peer.optimizer.state_dict())
                self.failover_store = self.token, self.failovers
                warn(
                    f"dogwild: the master, rank {old}, died; rank {me} is the master now, from its replica "
                    f"(members {members})"
                )
            else:
                pair = _pair(store, me, 0, 1, timeout_s)
                self.peer = _Peer(self, self.idents[self.lead], _Link(1, pair=pair), sent=peer.sent)
                self.peer.samples, self.peer.steps = peer.samples, peer.steps

    def _decide(self, store: dist.Store, old: int) -> None:
        """The first survivor to check in: waits for every live worker (``lost_after_s`` at most), then
        names the members."""
        n, deadline = self.world.world_size, time.monotonic() + self.lost_after_s
        while True:
            arrived = [r for r in range(n) if r != old and store.check([f"in/{r}"])]
            waiting = [r for r in range(n) if r != old and r not in arrived and self._alive(r)]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        store.set("members", json.dumps(arrived))

    def rejoin_step(self) -> int | None:
        """A replacement carries on at its predecessor's step count (rank 0's word on it)."""
        return self.start_step

    def begin_step(self, step: int) -> None:
        if not self.is_master and not self._as_peer(self.peer.begin_step):
            self.begin_step(step)  # the master died: again, in this rank's new role
            return
        if self.is_master:
            if self.options.max_ahead is not None:
                with self.timers.phase("wait_weights"):
                    # Counted in this life's gradients, not steps: after a resume the ranks restart
                    # from their own checkpoints' steps, which differ (an asynchronous run).
                    self.master.await_progress(self.master.taken[self.lead] - self.options.max_ahead)
            self.model.zero_grad(set_to_none=True)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.is_master:
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.finite(loss, grads, step):
                with self.timers.phase("apply"):
                    self.master.apply_own()
                self.master.samples[self.lead] += samples
            self.master.steps[self.lead] = step + 1
        elif not self._as_peer(self.peer.end_step, loss, samples, step):
            # Its send died with the master: the gradient goes again, in this rank's new role
            if not self.is_master:
                self.layout.gather_grads(self.model, self.peer.msgs[self.peer.cur][: self.layout.numel])
            return self.end_step(loss, samples, step)
        extra = {"staleness": self.staleness}
        if self.halted:
            extra["nonfinite"] = 1.0
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def finite(self, loss: torch.Tensor | None, grads: list[torch.Tensor], step: int) -> bool:
        """False, halting this process's training, when its loss or gradient is not finite."""
        if (loss is None or is_finite(loss)) and all(is_finite(g) for g in grads):
            return True
        self.halted = True
        warn(f"rank {self.world.rank}: non-finite loss or gradient at step {step}; it stops sending updates")
        return False

    def should_stop(self, step: int) -> bool:
        return self.halted or step >= self.ctx.steps

    def finish(self) -> None:
        """Workers say FINAL; rank 0 serves until every worker is done, halted or lost, then sends each
        the final weights, which the workers wait for."""
        if self.is_master:
            self.master.wait_for_workers()
        elif not self._as_peer(self.peer.finish):
            self.finish()  # the master died: again, in this rank's new role
            return
        self.timers.pop()

    def eval_model(self) -> nn.Module | None:
        """The master: a snapshot of the master weights ``w``."""
        return self.master.snapshot() if self.is_master else None

    def state_dict(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        with self.master.lock:
            return {
                "optimizer": self.master.optimizer.state_dict(),
                "master_weights": self.master.w.clone(),
                "worker_steps": torch.tensor([self.master.steps[r] for r in range(self.world.world_size)]),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.is_master and "master_weights" in state:
            m = self.master
            with m.lock:
                m.optimizer.load_state_dict(state["optimizer"])
                m.w.copy_(state["master_weights"])
                self.x.copy_(m.w)
                for r, n in enumerate(state.get("worker_steps", torch.zeros(0)).tolist()):
                    if r in m.steps:  # (a rank a resize to fewer workers dropped: no longer in the run)
                        m.steps[r] = max(m.steps[r], int(n))
                m.publish()  # the restored weights go out to every worker at once

    def total_samples(self, local: int) -> float:
        """The master: the samples of every gradient it applied (messages carry their sample count)."""
        return float(sum(self.master.samples.values())) if self.is_master else float(local)

    def summary_extra(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        m = self.master
        n = self.world.world_size
        extra = {"master": self.lead} if self.lead else {}
        return extra | {
            "lost_workers": sorted(m.lost),
            "nonfinite_workers": sorted(m.halted | ({self.lead} if self.halted else set())),
            "worker_steps": [m.steps[r] for r in range(n)],
            "applied_gradients": [m.held[r] for r in range(n)],
            "weights_broadcasts": [m.broadcasts[r] for r in sorted(m.broadcasts)],
            "max_staleness": m.max_staleness,
        }

    def close(self) -> None:
        for p in self.params:
            p.grad = None
        if self.failover_store is not None:
            token, generation = self.failover_store
            with contextlib.suppress(OSError):
                os.unlink(_failover_path(token, generation))


def _failover_path(token: int, generation: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"parambox-dogwild-{token:x}-{generation}")


def _failover_store(token: int, generation: int, timeout_s: float) -> dist.Store:
    """The survivors' meeting place after the master's death (one host: the local launcher's)."""
    return _file_store(_failover_path(token, generation), timeout_s)


def _file_store(path: str, timeout_s: float) -> dist.Store:
    store = dist.FileStore(path, -1)  # -1: never removed by torch (the run's folder goes at its end)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _message_group(world_size: int) -> dist.ProcessGroup | None:
    """A gloo group of this run's own over every rank: its threads send and receive while the loop
    may use the default group (another ``DistributedOptimizer``'s exchanges, the script's own
    collectives), whose messages would otherwise meet theirs."""
    if world_size == 1:
        return None
    return dist.new_group(backend="gloo")


def _identities(world_size: int, group: dist.ProcessGroup | None) -> tuple[list[int], int]:
    """Every rank's host hash and pid, so that a rank can tell a dead local peer from a slow one; and
    rank 0's token, which names the run's failover store."""
    token = random.getrandbits(62)
    if world_size == 1:
        return [process_identity()], token
    mine = torch.tensor([process_identity(), token], dtype=torch.int64)
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [int(t[0]) for t in out], int(out[0][1])


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _Link:
    """Rank 0 and one worker: the run's message group (``group``, the other end's rank ``peer``), or
    for a replacement a pair group of its own (``pair``)."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None, pair: Any = None):
        self.peer, self.group, self.pair = peer, group, pair

    def send(self, buf: torch.Tensor) -> dist.Work:
        if self.pair is not None:
            return self.pair.send([buf], 1 - self.pair.rank(), 0)
        return dist.isend(buf, dst=self.peer, group=self.group)

    def recv(self, buf: torch.Tensor) -> dist.Work:
        if self.pair is not None:
            return self.pair.recv([buf], 1 - self.pair.rank(), 0)
        return dist.irecv(buf, src=self.peer, group=self.group)


def _store(owner: Dogwild) -> dist.Store:
    """Where replacements meet the master: under the local launcher a file in the run's temporary
    folder, which outlives every rank (a master that took over serves it as rank 0 did); elsewhere the
    run's rendezvous store (rank 0 serves it: the same one its process group started on)."""
    world = owner.world
    if owner.board is not None:
        path = os.path.join(tempfile.gettempdir(), f"parambox-dogwild-{world.master_port}")
        return _file_store(path, _STORE_TIMEOUT_S)
    timeout = timedelta(seconds=_STORE_TIMEOUT_S)
    return pbdist.rendezvous_store(world, world.master_addr, world.master_port, timeout)


_STORE_TIMEOUT_S = 60.0


def _pair(store: dist.Store, r: int, life: int, rank: int, timeout_s: float) -> Any:
    prefix = dist.PrefixStore(f"dogwild/{r}/{life}/pair", store)
    return dist.ProcessGroupGloo(prefix, rank, 2, timedelta(seconds=timeout_s))


def _rejoin(owner: Dogwild) -> _Peer:
    """A replacement of rank ``r``: meet the master (rank 0, or the survivor that took over from it) over
    a pair group of this life, carry on at the dead rank's step count and gradient count, from the
    newest weights (waits for them)."""
    r, life, timeout_s = owner.world.rank, current_life(), owner.ctx.timeout_s
    store = _store(owner)
    store.set(f"dogwild/{r}/{life}/ident", str(process_identity()))
    store.set(f"dogwild/rejoin/{r}", str(life))
    with owner.collective("dogwild rejoin"):
        pair = _pair(store, r, life, 1, timeout_s)
    start, taken, master = (int(store.get(f"dogwild/{r}/{life}/{k}")) for k in ("start", "taken", "master"))
    owner.idents = json.loads(store.get(f"dogwild/{r}/{life}/idents"))
    owner.idents[r] = process_identity()
    owner.token = int(store.get(f"dogwild/{r}/{life}/token"))
    owner.lead = int(store.get(f"dogwild/{r}/{life}/lead"))
    owner.start_step = start
    peer = _Peer(owner, master, _Link(0, pair=pair), sent=taken)
    deadline = time.monotonic() + timeout_s
    while peer.newest is None and peer.error is None and time.monotonic() < deadline:
        peer.arrived.wait(_POLL_S)
    if peer.newest is None:
        raise CommTimeout(f"dogwild rejoin: no weights from rank {owner.lead} ({peer.error or 'none came'})")
    peer._adopt()
    return peer


class _Master:
    """The master's side (rank 0, or the survivor that took over): the weights ``w``, the optimizer, the
    receiving threads, one sender per worker.

    A master that takes over (``links``: its pair link to each surviving worker; ``counts``: every
    member's check-in: its gradients sent, steps, samples, life, and the per-rank gradients its replica
    holds) starts from its own replica; every rank that is not a member is lost."""

    def __init__(
        self,
        owner: Dogwild,
        idents: list[int],
        links: dict[int, _Link] | None = None,
        counts: dict[int, dict] | None = None,
    ):
        self.owner, self.idents = owner, idents
        n, numel = owner.world.world_size, owner.layout.numel
        self.me = owner.world.rank
        self.server = copy.deepcopy(owner.model)  # holds w; owner.model is the master's own replica x
        self.w = torch.empty_like(owner.x)
        owner.layout.bind_params_(self.server, self.w, copy_values=True)
        self.server_params = list(self.server.parameters())
        self.optimizer = owner.ctx.make_optimizer(self.server_params)
        self.result = copy.deepcopy(self.server)  # what evaluation sees: a copy taken under the lock
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # the version moved, or the run is closing
        self.version = 0
        self.news = 0  # moves with the version and whenever a rank is done, halted or lost
        self.closing = False
        self.own_done = False  # rank 0's own steps are over
        self.max_staleness = 0  # updates a gradient missed, the most over the run (rank 0's own too)
        self.max_lag = 0  # the most steps rank 0 ran ahead of the weights it computed on
        self.workers = set(links) if links is not None else set(range(1, n))
        self.applied = dict.fromkeys(range(n), 0)  # gradients applied per rank
        self.held = dict.fromkeys(range(n), 0)  # gradients w holds per rank (applied, or inherited)
        self.steps = dict.fromkeys(range(n), 0)  # steps done per rank, as each last said
        self.samples = dict.fromkeys(range(n), 0)  # their samples
        self.last_staleness = dict.fromkeys(range(n), 0)  # of each rank's last applied gradient
        self.taken = dict.fromkeys(range(n), 0)  # gradient messages received per rank (applied or not)
        self.broadcasts = dict.fromkeys(self.workers, 0)  # weight messages sent per worker
        self.done: set[int] = set()  # sent FINAL or HALT
        self.halted: set[int] = set()
        self.lost: set[int] = set()
        self.heard = {r: time.monotonic() for r in self.workers}
        self.inboxes = {r: torch.empty(numel + HEADER) for r in self.workers}
        self.links = links if links is not None else {r: _Link(r, owner.pg) for r in self.workers}
        self.lives = dict.fromkeys(self.workers, 0)  # the life of each worker's process rank 0 talks to
        self.skew = dict.fromkeys(range(n), 0)  # a replacement's gradients counted as caught up
        self.lost_at: dict[int, float] = {}
        if counts is not None:
            self._inherit(counts)
        self.board = WorkerBoard.from_env()  # the local launcher's: replacements under way
        self.staged = None if self.w.device.type == "cpu" else torch.empty_like(self.w)
        self.used_version = 0  # the version rank 0's own replica holds
        # One receiver per worker, not one receive from any source: gloo fails a pending any-source
        # receive when any one peer's connection resets, which lost every worker with the dead one.
        self.receivers: dict[int, threading.Thread] = {}
        self.senders: dict[int, threading.Thread] = {}
        for r in sorted(self.workers):
            self._start_threads(r)
        world = owner.world
        if counts is not None:
            with self.lock:
                self.publish()  # w is this rank's replica: every member adopts it at once
        if self.board is not None and world.master_addr and world.master_port and len(self.taken) > 1:
            # replacements can come (--max-restarts under the local launcher)
            threading.Thread(target=self._admit, name="dogwild-admit", daemon=True).start()

    def _inherit(self, counts: dict[int, dict]) -> None:
        """A master that took over: every member's counts; the others are lost."""
        now = time.monotonic()
        for r, c in counts.items():
            self.taken[r], self.steps[r], self.samples[r] = c["sent"], c["steps"], c["samples"]
            self.lives[r] = c.get("life", 0)
        for r, got in enumerate(counts[self.me]["held"]):  # what its replica, now w, holds
            self.held[r] = int(got)
        for r in range(len(self.taken)):
            if r != self.me and r not in counts:
                self.lost.add(r)
                self.lost_at[r] = now
            if r not in counts:  # a rank lost at this or an earlier failover: at least what w holds of it
                self.steps[r] = max(self.steps[r], self.held[r])

    def _start_threads(self, r: int) -> None:
        link = self.links[r]
        self.receivers[r] = threading.Thread(target=self._serve, args=(r, link), daemon=True)
        self.senders[r] = threading.Thread(target=self._broadcast_to, args=(r, link), daemon=True)
        self.receivers[r].start()
        self.senders[r].start()

    def _admit(self) -> None:
        """Replacements of lost ranks: each meets this master over a pair group of its life, and carries
        on from the dead rank's step and gradient counts."""
        store = None
        while not self.closing:
            time.sleep(_POLL_S)
            for r in sorted(self.lost):
                store = store or _store(self.owner)
                if not store.check([f"dogwild/rejoin/{r}"]):
                    continue
                life = int(store.get(f"dogwild/rejoin/{r}"))
                if life > self.lives.get(r, 0):
                    self._admit_one(store, r, life)

    def _admit_one(self, store: dist.Store, r: int, life: int) -> None:
        with self.lock:
            ident = int(store.get(f"dogwild/{r}/{life}/ident"))
            store.set(f"dogwild/{r}/{life}/start", str(self.steps[r]))
            store.set(f"dogwild/{r}/{life}/taken", str(self.taken[r]))
            store.set(f"dogwild/{r}/{life}/master", str(self.idents[self.me]))
            store.set(f"dogwild/{r}/{life}/lead", str(self.me))
            store.set(f"dogwild/{r}/{life}/idents", json.dumps(self.idents))
            store.set(f"dogwild/{r}/{life}/token", str(self.owner.token))
            self.lives[r] = life
        try:
            pair = _pair(store, r, life, 0, self.owner.ctx.timeout_s)
        except RuntimeError:
            return  # it died too: still lost
        with self.lock:
            if r not in self.workers:  # the master that died (a master that took over admits it)
                self.workers.add(r)
                self.inboxes[r] = torch.empty(self.owner.layout.numel + HEADER)
                self.broadcasts[r] = 0
            self.links[r], self.idents[r] = _Link(1, pair=pair), ident
            live = [self.taken[q] + self.skew[q] for q in self.taken if q not in self.done | self.lost]
            self.skew[r] = max(0, max(live, default=0) - self.taken[r])
            self.lost.discard(r)
            self.heard[r] = time.monotonic()
            self.announce()
            self._start_threads(r)
        warn(f"worker rank {r} replaced; it carries on from step {self.steps[r]}")

    def publish(self) -> None:
        """``w`` changed: the senders share it (the caller holds the lock)."""
        self.version += 1
        self.announce()

    def announce(self) -> None:
        """Something a broadcast carries changed (the caller holds the lock)."""
        self.news += 1
        self.changed.notify_all()

    def progress(self) -> list[float]:
        """Per rank, how many of its gradients ``w`` holds; inf where the rank no longer counts for
        bounded staleness (done, halted, lost). The caller holds the lock."""
        gone = self.done | self.lost | ({self.me} if self.own_done or self.owner.halted else set())
        return [
            float("inf") if r in gone else float(self.taken[r] + self.skew[r]) for r in range(len(self.taken))
        ]

    def await_progress(self, needed: int) -> None:
        """Rank 0, before a step: until ``w`` holds every rank's gradients up to ``needed``."""
        deadline = time.monotonic() + self.owner.ctx.timeout_s
        with self.changed:
            while min(self.progress()) < needed:
                self._find_lost()  # a dead worker must not hold rank 0 up: it stops counting
                if min(self.progress()) >= needed:
                    break
                if time.monotonic() > deadline:
                    why = f"none came in {self.owner.ctx.timeout_s:.0f} s"
                    raise CommTimeout(
                        f"dogwild: rank {self.me} waiting for the slowest worker's gradients ({why})"
                    )
                self.changed.wait(_POLL_S)
            self.max_lag = max(self.max_lag, self.taken[self.me] - int(min(self.progress())))

    def _apply_(self, grads: list[torch.Tensor]) -> None:
        """One optimizer step on ``w`` with these gradients (the caller holds the lock)."""
        for p, g in zip(self.server_params, grads):
            p.grad = g if p.requires_grad else None  # frozen: never moved, not even by weight decay
        self.optimizer.step()
        for p in self.server_params:
            p.grad = None
        self.publish()

    def apply_own(self) -> None:
        """Rank 0's own gradient, then its replica catches up with ``w``."""
        owner = self.owner
        with self.lock:
            owner.staleness = float(self.version - self.used_version)
            self.max_staleness = max(self.max_staleness, self.version - self.used_version)
            self._apply_([p.grad for p in owner.params])
            self.applied[self.me] += 1
            self.held[self.me] += 1
            self.taken[self.me] += 1
            owner.x.copy_(self.w)
            self.used_version = self.version
        owner.model.zero_grad(set_to_none=True)

    def _find_lost(self) -> None:
        """Mark lost the workers whose process is gone or that were silent ``lost_after_s`` (the
        caller holds the lock)."""
        now = time.monotonic()
        for r in sorted(self.workers - self.done - self.lost):
            if identity_gone(self.idents[r]) or now - self.heard[r] > self.owner.lost_after_s:
                self._mark_lost(r)

    # -- the receiving thread ---------------------------------------------------------------------------
    def _serve(self, r: int, link: _Link) -> None:
        """Worker ``r``'s messages, until it is done or lost (silent ``lost_after_s``, or its
        connection broke: it died)."""
        try:
            while r not in self.done and r not in self.lost and self.links[r] is link:
                work = link.recv(self.inboxes[r])
                # One wait per receive: a gloo receive that timed out cannot be posted again safely.
                work.wait(timeout=timedelta(seconds=self.owner.lost_after_s))
                self._handle(r)
        except Exception:  # a timeout (the worker silent) or a broken connection: it is lost
            with self.lock:
                if self.links[r] is link:  # (not a replacement's: it has a link of its own)
                    self._mark_lost(r)

    def _handle(self, src: int) -> None:
        numel, msg = self.owner.layout.numel, self.inboxes[src]
        kind, used = float(msg[numel]), int(msg[numel + 1])
        self.steps[src] = max(self.steps[src], int(msg[numel + 4]))
        self.heard[src] = time.monotonic()
        if kind != GRAD:
            with self.lock:
                self.done.add(src)
                if kind == HALT:
                    self.halted.add(src)
                self.announce()  # the others' bounded wait no longer counts this rank
            return
        grad = msg[:numel]
        with self.lock:
            if is_finite(grad):  # workers check before sending; this keeps w finite regardless
                if self.staged is not None:
                    grad = self.staged.copy_(grad)  # GPU weights: the gradient goes over first
                self.last_staleness[src] = self.version - used
                self.max_staleness = max(self.max_staleness, self.version - used)
                self._apply_(list(self.owner.layout.views(grad).values()))
                self.applied[src] += 1
                self.held[src] += 1
                self.samples[src] += int(msg[numel + 3])
            else:
                warn(f"rank {self.me}: dropped a non-finite gradient from rank {src}")
                self.publish()  # the sender's count moved: its bounded wait must hear of it
            self.taken[src] += 1

    # -- one sender per worker ------------------------------------------------------------------------------
    def _broadcast_to(self, r: int, link: _Link) -> None:
        """Send worker ``r`` the newest weights whenever they moved (one message in flight: updates
        that land meanwhile are coalesced into the next); after the end, the final weights once."""
        numel = self.owner.layout.numel
        n = len(self.taken)
        buf = torch.empty(numel + BCAST_HEADER + 2 * n)
        sent = 0  # every rank starts from the same weights: news 0 need not travel

        def news() -> bool:
            if r in self.lost or self.closing or self.links[r] is not link:
                return True
            return r not in self.done and self.news != sent

        while True:
            with self.changed:
                self.changed.wait_for(news)
                if r in self.lost or self.links[r] is not link:
                    return
                final = self.closing
                buf[:numel].copy_(self.w)
                header = [self.version, self.last_staleness[r], final, self.taken[r], *self.progress()]
                header += [self.held[q] for q in range(n)]
                buf[numel:] = torch.tensor([float(v) for v in header])
                sent = self.news
            if not self._send(buf, r, link) or final:
                return

    def _send(self, buf: torch.Tensor, r: int, link: _Link) -> bool:
        """One broadcast message to ``r``; False (and ``r`` is lost) if it cannot be delivered."""
        try:
            work = link.send(buf)
            work.wait(timeout=timedelta(seconds=self.owner.lost_after_s))
        except RuntimeError:  # gloo refuses at once when the worker's connection is gone
            with self.lock:
                if self.links[r] is link:
                    self._mark_lost(r)
            return False
        self.broadcasts[r] += 1
        return True

    def _mark_lost(self, r: int) -> None:
        if r not in self.lost and r not in self.done:
            self.lost.add(r)
            self.lost_at[r] = time.monotonic()
            self.announce()
            warn(f"worker rank {r} is lost (it died or stalled); finishing without it")

    # -- the end --------------------------------------------------------------------------------------
    def wait_for_workers(self) -> None:
        """Until every worker has finished, halted or is lost; then the final weights to each worker
        still there. A thread left blocked on a lost worker is a daemon: destroying the process group
        under it is safe, and nobody will send to it."""
        with self.lock:
            self.own_done = True  # rank 0's steps no longer hold the workers' bounded wait
            self.announce()
        while self.workers - self.done - self.lost or self._replacing():
            time.sleep(_POLL_S)
            now = time.monotonic()
            with self.lock:
                for r in sorted(self.workers - self.done - self.lost):
                    if (
                        not self.receivers[r].is_alive()
                        or identity_gone(self.idents[r])
                        or now - self.heard[r] > self.owner.lost_after_s
                    ):
                        self._mark_lost(r)
        with self.changed:
            self.closing = True
            self.changed.notify_all()
            self.owner.x.copy_(self.w)  # rank 0's replica ends as every worker's: the result
            self.used_version = self.version
        deadline = time.monotonic() + self.owner.lost_after_s
        for r, t in self.senders.items():
            if r not in self.lost:
                t.join(max(0.0, deadline - time.monotonic()))

    def _replacing(self) -> bool:
        """A lost worker's replacement is under way (the launcher started a newer life of it), and
        has not been gone ``lost_after_s``."""
        if self.board is None:
            return False
        now = time.monotonic()
        return any(
            self.board.life(r) > self.lives.get(r, 0)
            and not self.board.dead(r)
            and now - self.lost_at.get(r, now) < self.owner.lost_after_s
            for r in list(self.lost)
        )

    def snapshot(self) -> nn.Module:
        with self.lock, torch.no_grad():
            for dst, src in zip(self.result.parameters(), self.server_params):
                dst.copy_(src)
            for dst, src in zip(self.result.buffers(), self.owner.model.buffers()):
                dst.copy_(src)  # buffers (batch-norm statistics) are not exchanged: rank 0's own
        return self.result


class _Peer:
    """A worker's side: gradients out without waiting, the newest weights in as they come."""

    def __init__(self, owner: Dogwild, master_ident: int, link: _Link, sent: int = 0):
        self.owner, self.master_ident, self.link = owner, master_ident, link
        numel = owner.layout.numel
        self.msgs = [torch.zeros(numel + HEADER) for _ in range(2)]  # alternate: one may be in flight
        self.sends: list[dist.Work | None] = [None, None]
        self.cur = 0
        self.on_host = owner.x.device.type == "cpu"
        if self.on_host:  # backward accumulates straight into the message
            self.grads = [GradViews.of_flat(owner.model, owner.layout, m[:numel]) for m in self.msgs]
        n = owner.world.world_size
        self.inbox = [torch.empty(numel + BCAST_HEADER + 2 * n) for _ in range(2)]
        self.newest: int | None = None  # the inbox buffer holding the newest complete broadcast
        self.lock = threading.Lock()
        self.final = threading.Event()
        self.arrived = threading.Event()  # a broadcast came since the last look
        self.sent = sent  # gradients sent (a replacement: its predecessor's too)
        self.acked = sent  # of which the newest weights adopted hold (or rank 0 dropped)
        self.progress = [0.0] * owner.world.world_size  # every rank's gradients those weights hold
        self.held = [0.0] * owner.world.world_size  # ... of which they hold (a failover loses a few)
        self.max_lag = 0  # the most steps this worker ran ahead of the weights it computed on
        # The worker's own updates, applied to x by an optimizer of its own; kept as (number of the
        # gradient, x after - x before) until the weights adopted hold that gradient.
        self.optimizer = owner.ctx.make_optimizer(owner.params)
        self.pending: deque[tuple[int, torch.Tensor]] = deque()
        self.error: str | None = None
        self.version = 0  # the version of the weights in x
        self.adopted = 0  # broadcasts copied into x
        self.steps = 0
        self.samples = 0  # of the gradients sent (a master that takes over counts them)
        self.receiver = threading.Thread(target=self._receive, name="dogwild-receive", daemon=True)
        self.receiver.start()

    # -- the receiving thread -----------------------------------------------------------------------
    def _receive(self) -> None:
        """Broadcasts from rank 0 into the buffer that is not the newest, until the final one."""
        numel, k = self.owner.layout.numel, 0
        try:
            while True:
                work = self.link.recv(self.inbox[k])
                work.wait(timeout=_FOREVER)  # rank 0 is quiet while nothing changes; a dead one errs
                final = bool(self.inbox[k][numel + 2])
                with self.lock:
                    self.newest, k = k, 1 - k
                self.arrived.set()
                if final:
                    self.final.set()
                    return
        except Exception as e:
            self.error = _first_line(e)
            self.final.set()

    def _adopt(self) -> None:
        """``x`` := the newest weights received, if they are newer (never waits for any)."""
        owner, numel = self.owner, self.owner.layout.numel
        with self.lock:
            if self.newest is None:
                return
            buf = self.inbox[self.newest]
            version = int(buf[numel])
            owner.staleness = float(buf[numel + 1])
            self.acked = int(buf[numel + 3])
            n = len(self.progress)
            self.progress = buf[numel + BCAST_HEADER : numel + BCAST_HEADER + n].tolist()
            self.held = buf[numel + BCAST_HEADER + n :].tolist()
            if version != self.version:
                owner.x.copy_(buf[:numel])
                self.version = version
                self.adopted += 1
                while self.pending and self.pending[0][0] <= self.acked:
                    self.pending.popleft()
                for _, delta in self.pending:  # this worker's own steps the master has not taken yet
                    owner.x.add_(delta)

    # -- the step ----------------------------------------------------------------------------------------
    def lag(self) -> float:
        """Steps this worker is ahead of the weights it holds: its gradients sent, less the fewest
        gradients of any rank that still counts (its own among them) that those weights hold."""
        return self.sent - min(self.progress)

    def begin_step(self) -> None:
        self._adopt()
        ahead = self.owner.options.max_ahead
        if ahead is not None and self.lag() > ahead:
            with self.owner.timers.phase("wait_weights"):
                self._await_weights(ahead)
        self.max_lag = max(self.max_lag, int(self.lag()))
        k = self.cur
        self._settle(k)
        if self.on_host:
            self.msgs[k].zero_()
            self.grads[k].rebind_()
        else:
            self.owner.model.zero_grad(set_to_none=True)

    def _await_weights(self, ahead: int) -> None:
        """Bounded staleness: until the newest weights hold every rank's gradients but ``ahead``."""
        deadline = time.monotonic() + self.owner.ctx.timeout_s
        while self.lag() > ahead:
            self.arrived.wait(_POLL_S)
            self.arrived.clear()
            self._adopt()
            if self.error is not None or time.monotonic() > deadline:
                why = self.error or f"none came in {self.owner.ctx.timeout_s:.0f} s"
                raise CommTimeout(f"dogwild: waiting for weights from rank {self.owner.lead} ({why})")

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> None:
        owner, numel, msg = self.owner, self.owner.layout.numel, self.msgs[self.cur]
        if self.on_host:
            self.grads[self.cur].settle_()  # a .grad the loop detached from the message goes into it
        else:
            owner.layout.gather_grads(owner.model, msg[:numel])
        if not owner.finite(loss, [msg[:numel]], step):
            self._send(HALT, loss, 0, step)
            return
        self._send(GRAD, loss, samples, step + 1)
        self.sent += 1
        self.samples += samples
        self._apply_own()
        if self.on_host:  # the message is in flight: no .grad may point into it until begin_step
            for p in owner.params:
                p.grad = None

    def _apply_own(self) -> None:
        """The worker's own gradient onto its replica ``x`` (the send only reads the gradient)."""
        owner = self.owner
        with owner.timers.phase("apply_own"):
            before = owner.x.clone()
            self.optimizer.step()
            self.pending.append((self.sent, owner.x - before))

    def _settle(self, k: int) -> None:
        """Wait until message buffer ``k``'s last send has been taken (back-pressure)."""
        work, self.sends[k] = self.sends[k], None
        if work is not None:
            with self.owner.timers.phase("send"), self.owner.collective("dogwild sending a gradient"):
                work.wait(timeout=timedelta(seconds=self.owner.ctx.timeout_s))

    def _send(self, kind: float, loss: torch.Tensor | None, samples: int, steps: int) -> None:
        """The message in the current buffer goes out; the next step fills the other one."""
        numel, k = self.owner.layout.numel, self.cur
        self.steps = steps
        header = [kind, float(self.version), loss_value(loss), float(samples), float(steps)]
        self.msgs[k][numel:] = torch.tensor(header)
        with self.owner.collective("dogwild sending a gradient"):
            self.sends[k] = self.link.send(self.msgs[k])
        self.cur = 1 - k

    # -- the end -------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Say FINAL (a HALT already said this worker is leaving), then wait for the final weights."""
        owner = self.owner
        if not owner.halted:
            self._settle(self.cur)
            self._send(FINAL, None, 0, self.steps)
        for k in range(2):
            self._settle(k)
        deadline = time.monotonic() + owner.ctx.timeout_s
        with owner.timers.phase("final_weights"):
            while not self.final.wait(_POLL_S):
                if identity_gone(self.master_ident) or time.monotonic() > deadline:
                    break
        if self.error is not None or not self.final.is_set():
            why = self.error or f"none came in {owner.ctx.timeout_s:.0f} s"
            raise CommTimeout(f"dogwild finish: no final weights from rank {owner.lead} ({why})")
        self._adopt()
