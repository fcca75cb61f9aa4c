"""``dogwild``: a master holds the weights, applies each worker's gradient as it arrives, sends weights back.

The message-passing counterpart of the box strategies (Dogwild: distributed Hogwild by messages).
Rank 0 is the master and trains too, so ``--workers N`` gives N processes computing gradients (the
default digits run with 2 workers has two). The weights ``w`` and the one optimizer that applies
every gradient live on rank 0; every process computes on a replica ``x``.

A worker's step: compute ``g`` on ``x``, ``isend`` it to rank 0 (two-sided torch.distributed
point-to-point over gloo), wait for the weights rank 0 sends back after applying ``g``, ``x <- w``.

Rank 0 serves in a thread: it blocks in ``irecv(src=None)`` (receive from any source; gloo cannot
poll a pending receive), applies the gradient with the optimizer (``optimizer.step()`` on ``w``),
and ``isend``s the fresh weights, with the version and the gradient's staleness, to that worker.
Between its own forward/backward passes rank 0's main thread applies its own gradient the same way
and refreshes its replica; a lock keeps the two threads from stepping the optimizer together. The
replica is not ``w`` itself, so a gradient applied mid-backward never invalidates autograd's saved
tensors. Optimizer state (momentum) exists once, on rank 0, so no learning-rate scaling is needed
beyond what staleness asks for (about one update here: the others' gradients applied meanwhile).

Termination: every process does its steps. A worker's last message is ``FINAL``; in ``finish``
rank 0 waits until each worker has sent it, has halted, or is lost: silent for ``lost_after_s``
(default ``--timeout``), or its process gone (same host). A worker whose loss or gradient is not
finite sends ``HALT`` instead of the gradient and leaves the run; rank 0 checks every gradient
again before applying it, so ``w`` stays finite.
Messages (float32, host memory): ``[gradient | kind, version used, loss, samples, steps done]``; replies
``[weights | version, staleness]``. They travel over gloo also when the run's backend is nccl (a
gloo group of their own: NCCL has no receive-from-any); GPU gradients and weights are staged
through the host buffers.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from parambox.box import Layout
from parambox.errors import warn
from parambox.numerics import is_finite
from parambox.runtime.spawn import identity_gone, process_identity
from parambox.strategies.base import Context, GradViews, Options, StepResult, Strategy, loss_value

GRAD, FINAL, HALT = 0.0, 1.0, 2.0  # message kinds (the first element after the gradient)
HEADER, REPLY_HEADER = 5, 2
_POLL_S = 0.05


class DogwildOptions(Options):
    lost_after_s: float | None = Field(
        None, gt=0, description="a worker silent this long is lost (default: --timeout)"
    )


class Dogwild(Strategy):
    """Rank 0 applies gradients as they come and answers with weights; the others send gradients.

    >>> # parambox train --strategy dogwild --workers 3   (rank 0 + 2 workers, all computing)
    """

    name = "dogwild"
    Options = DogwildOptions
    tolerates_worker_loss = True

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
        with self.collective("dogwild start-up"):
            self.pg = _message_group(self.world.world_size)
            idents = _identities(self.world.world_size, self.pg)
        if self.world.rank == 0:
            self.master = _Master(self, idents)
        else:
            self.peer = _Peer(self)

    def begin_step(self, step: int) -> None:
        if self.world.rank == 0:
            self.model.zero_grad(set_to_none=True)
        else:
            self.peer.begin_step()

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.world.rank == 0:
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.finite(loss, grads, step):
                with self.timers.phase("apply"):
                    self.master.apply_own()
                self.master.samples[0] += samples
            self.master.steps[0] = step + 1
        else:
            self.peer.end_step(loss, samples, step)
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
        """Workers say FINAL; rank 0 serves until every worker is done, halted or lost."""
        if self.world.rank == 0:
            self.master.wait_for_workers()
        else:
            self.peer.finish()
        self.timers.pop()

    def eval_model(self) -> nn.Module | None:
        """Rank 0: a snapshot of the master weights ``w``."""
        return self.master.snapshot() if self.world.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        if self.world.rank != 0:
            return {}
        with self.master.lock:
            return {
                "optimizer": self.master.optimizer.state_dict(),
                "master_weights": self.master.w.clone(),
                "worker_steps": torch.tensor([self.master.steps[r] for r in range(self.world.world_size)]),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.world.rank == 0 and "master_weights" in state:
            with self.master.lock:
                self.master.optimizer.load_state_dict(state["optimizer"])
                self.master.w.copy_(state["master_weights"])
                self.x.copy_(self.master.w)
                for r, n in enumerate(state.get("worker_steps", torch.zeros(0)).tolist()):
                    self.master.steps[r] = max(self.master.steps[r], int(n))

    def total_samples(self, local: int) -> float:
        """Rank 0: the samples of every gradient it applied (messages carry their sample count)."""
        return float(sum(self.master.samples.values())) if self.world.rank == 0 else float(local)

    def summary_extra(self) -> dict[str, Any]:
        if self.world.rank != 0:
            return {}
        m = self.master
        return {
            "lost_workers": sorted(m.lost),
            "nonfinite_workers": sorted(m.halted | ({0} if self.halted else set())),
            "worker_steps": [m.steps[r] for r in range(self.world.world_size)],
        }

    def close(self) -> None:
        for p in self.params:
            p.grad = None


def _message_group(world_size: int) -> dist.ProcessGroup | None:
    """The default group where it is gloo; a gloo group over every rank otherwise (nccl)."""
    if world_size == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _identities(world_size: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's host hash and pid, so that rank 0 can tell a dead local worker from a slow one."""
    if world_size == 1:
        return [process_identity()]
    mine = torch.tensor([process_identity()], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


class _Master:
    """Rank 0's side: the weights ``w``, the optimizer, the serving thread, the end of the run."""

    def __init__(self, owner: Dogwild, idents: list[int]):
        self.owner, self.idents = owner, idents
        n, numel = owner.world.world_size, owner.layout.numel
        self.server = copy.deepcopy(owner.model)  # holds w; owner.model is rank 0's replica x
        self.w = torch.empty_like(owner.x)
        owner.layout.bind_params_(self.server, self.w, copy_values=True)
        self.server_params = list(self.server.parameters())
        self.optimizer = owner.ctx.make_optimizer(self.server_params)
        self.result = copy.deepcopy(self.server)  # what evaluation sees: a copy taken under the lock
        self.lock = threading.Lock()
        self.version = 0
        self.workers = set(range(1, n))
        self.applied = dict.fromkeys(range(n), 0)  # gradients applied per rank
        self.steps = dict.fromkeys(range(n), 0)  # steps done per rank, as each last said
        self.samples = dict.fromkeys(range(n), 0)  # their samples
        self.done: set[int] = set()  # sent FINAL or HALT
        self.halted: set[int] = set()
        self.lost: set[int] = set()
        self.heard = {r: time.monotonic() for r in self.workers}
        self.inbox = torch.empty(numel + HEADER)
        self.staged = None if self.w.device.type == "cpu" else torch.empty_like(self.w)
        self.replies = {r: torch.empty(numel + REPLY_HEADER) for r in self.workers}
        self.sends: dict[int, dist.Work] = {}
        self.used_version = 0  # the version rank 0's own replica holds
        self.error: str | None = None
        self.thread = threading.Thread(target=self._serve, name="dogwild-server", daemon=True)
        if self.workers:
            self.thread.start()

    def _apply_(self, grads: list[torch.Tensor]) -> None:
        """One optimizer step on ``w`` with these gradients (the caller holds the lock)."""
        for p, g in zip(self.server_params, grads):
            p.grad = g if p.requires_grad else None  # frozen: never moved, not even by weight decay
        self.optimizer.step()
        for p in self.server_params:
            p.grad = None
        self.version += 1

    def apply_own(self) -> None:
        """Rank 0's own gradient, then its replica catches up with ``w``."""
        owner = self.owner
        with self.lock:
            owner.staleness = float(self.version - self.used_version)
            self._apply_([p.grad for p in owner.params])
            self.applied[0] += 1
            owner.x.copy_(self.w)
            self.used_version = self.version
        owner.model.zero_grad(set_to_none=True)

    # -- the serving thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while self.workers - self.done - self.lost:
                work = dist.irecv(self.inbox, src=None, group=self.owner.pg)
                # One wait per receive: a gloo receive that timed out cannot be posted again safely.
                work.wait(timeout=timedelta(seconds=self.owner.lost_after_s))
                self._handle(work._source_rank())
        except Exception as e:  # a timeout (every live worker silent) or a broken connection
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__

    def _handle(self, src: int) -> None:
        numel, msg = self.owner.layout.numel, self.inbox
        kind, used = float(msg[numel]), int(msg[numel + 1])
        self.steps[src] = max(self.steps[src], int(msg[numel + 4]))
        self.heard[src] = time.monotonic()
        if kind != GRAD:
            self.done.add(src)
            if kind == HALT:
                self.halted.add(src)
            return
        grad, reply = msg[:numel], self.replies[src]
        self._wait_send(src)
        with self.lock:
            staleness = self.version - used
            if is_finite(grad):  # workers check before sending; this keeps w finite regardless
                if self.staged is not None:
                    grad = self.staged.copy_(grad)  # GPU weights: the gradient goes over first
                self._apply_(list(self.owner.layout.views(grad).values()))
                self.applied[src] += 1
                self.samples[src] += int(msg[numel + 3])
            else:
                warn(f"rank 0: dropped a non-finite gradient from rank {src}")
            reply[:numel].copy_(self.w)
            reply[numel], reply[numel + 1] = float(self.version), float(staleness)
        try:
            self.sends[src] = dist.isend(reply, dst=src, group=self.owner.pg)
        except RuntimeError:  # gloo refuses at once when the worker's connection is gone
            self._mark_lost(src)

    def _wait_send(self, dst: int) -> None:
        work = self.sends.pop(dst, None)
        if work is not None:
            try:
                work.wait(timeout=timedelta(seconds=self.owner.lost_after_s))
            except RuntimeError:
                self._mark_lost(dst)

    def _mark_lost(self, r: int) -> None:
        if r not in self.lost and r not in self.done:
            self.lost.add(r)
            warn(f"worker rank {r} is lost (it died or stalled); finishing without it")

    # -- the end --------------------------------------------------------------------------------------
    def wait_for_workers(self) -> None:
        """Until every worker has finished, halted or is lost. A serving thread left blocked on a lost
        worker is a daemon: destroying the process group under it is safe, and nobody will send to it."""
        while self.workers - self.done - self.lost:
            self.thread.join(_POLL_S)
            now, gave_up = time.monotonic(), not self.thread.is_alive()
            for r in sorted(self.workers - self.done - self.lost):
                if gave_up or identity_gone(self.idents[r]) or now - self.heard[r] > self.owner.lost_after_s:
                    self._mark_lost(r)
        if not self.thread.is_alive():
            for dst in list(self.sends):
                self._wait_send(dst)

    def snapshot(self) -> nn.Module:
        with self.lock, torch.no_grad():
            for dst, src in zip(self.result.parameters(), self.server_params):
                dst.copy_(src)
            for dst, src in zip(self.result.buffers(), self.owner.model.buffers()):
                dst.copy_(src)  # buffers (batch-norm statistics) are not exchanged: rank 0's own
        return self.result


class _Peer:
    """A worker's side: one gradient out, one reply back, per step."""

    def __init__(self, owner: Dogwild):
        self.owner = owner
        numel = owner.layout.numel
        self.msg = torch.zeros(numel + HEADER)
        self.on_host = owner.x.device.type == "cpu"
        if self.on_host:  # backward accumulates straight into the message
            self.grads = GradViews.of_flat(owner.model, owner.layout, self.msg[:numel])
        self.reply = torch.empty(numel + REPLY_HEADER)
        self.version = 0
        self.steps = 0

    def begin_step(self) -> None:
        if self.on_host:
            self.msg.zero_()
            self.grads.rebind_()
        else:
            self.owner.model.zero_grad(set_to_none=True)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> None:
        owner, numel = self.owner, self.owner.layout.numel
        if not self.on_host:
            owner.layout.gather_grads(owner.model, self.msg[:numel])
        if not owner.finite(loss, [self.msg[:numel]], step):
            self._send(HALT, loss, 0, step)
            return
        pending = dist.irecv(self.reply, src=0, group=owner.pg)  # posted first: no unexpected message
        self._send(GRAD, loss, samples, step + 1)
        with owner.timers.phase("recv"):
            self._wait(pending, "waiting for fresh weights from rank 0")
        owner.x.copy_(self.reply[:numel])
        self.version, owner.staleness = int(self.reply[numel]), float(self.reply[numel + 1])

    def _send(self, kind: float, loss: torch.Tensor | None, samples: int, steps: int) -> None:
        numel = self.owner.layout.numel
        self.steps = steps
        header = [kind, float(self.version), loss_value(loss), float(samples), float(steps)]
        self.msg[numel:] = torch.tensor(header)
        with self.owner.timers.phase("send"):
            self._wait(dist.isend(self.msg, dst=0, group=self.owner.pg), "sending a gradient")

    def _wait(self, work: dist.Work, phase: str) -> None:
        with self.owner.collective(f"dogwild {phase}"):
            work.wait(timeout=timedelta(seconds=self.owner.ctx.timeout_s))

    def finish(self) -> None:
        if not self.owner.halted:  # a HALT already told rank 0 that this worker is leaving
            self._send(FINAL, None, 0, self.steps)
