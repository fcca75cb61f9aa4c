"""``box-sync``: synchronous gradient averaging through the box instead of allreduce (SMB thesis).

The box holds one gradient slot per worker, twice over (even and odd steps), so a worker can
write step t+1's gradient while a slower one still reads step t's. A step: each worker's
gradient lands in its slot; one cheap barrier in the box; every worker sums the slots into its
local gradient and steps its own optimizer (all replicas stay identical, as with allreduce).

On the ``shm`` box the parameters' ``.grad`` are views into the worker's shared slot, so backward
accumulates straight into shared memory: no gradient is copied before averaging, and there are no
communication threads competing with the compute threads (what costs DDP ~9 ms a step here). On
boxes without that view (``rma``, or ``zero_copy=false``) the box holds no slots but one sum per
step (``box/levels.py``): each worker pushes its gradient scaled by 1/n into it and after the barrier
pulls the mean (a byte of gradient crosses the link once each way, as in a ring allreduce, instead of
every worker reading every slot); across nodes with several workers per node, in two levels: the
node's shm box sums its workers' gradients and only the node's leader crosses the link.

Surviving in place (``on_failure = "shrink"``, the shm box's slots): the barrier is each worker's
step counter in the box (a worker posts its step once its slot is written, and waits for the other
members' posts), which a dead rank simply stops moving. A survivor waiting on it sees the launcher's
board mark the rank dead and regroups at once; a stalled rank runs it into ``--timeout``. The
survivors average the members' slots only (a rank left out may write its slot on waking: nobody
reads it), and a replacement takes the dead rank's slot and counter at the step it is admitted.
Buffers (batch-norm statistics) are rank 0's, broadcast at the end of the exchange.
"""

from __future__ import annotations

import torch
from pydantic import Field

from parambox.box import Layout, open_box
from parambox.box.base import step_counter, wait_until
from parambox.box.levels import BoxMean
from parambox.errors import UserError
from parambox.runtime.elastic import PeerLost
from parambox.runtime.survival import CAUGHT_UP
from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value
from parambox.strategies.grads import BackwardPasses, FinishedTail, GradViews


class BoxSyncOptions(Options):
    zero_copy: bool = Field(True, description="shm: backward accumulates straight into the shared slot")
    bucket_mb: float = Field(
        1.0,
        ge=0,
        description="rma across nodes: push each finished gradient bucket of this size during "
        "backward (DDP's first bucket); 0: push after backward",
    )


class BoxSync(Strategy):
    name = "box-sync"
    Options = BoxSyncOptions
    survives_in_place = True

    def __init__(self, ctx: Context, options: BoxSyncOptions):
        super().__init__(ctx, options)
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.layout = Layout.from_shapes((name, p.shape) for name, p in named)
        n, numel = self.world.world_size, self.layout.numel
        self.slot = numel + len(self.params)  # gradients, then a "got a gradient" flag per parameter
        # Zero copy where backward can write into the box itself; elsewhere the box sums the pushes.
        # A run that survives in place needs each member's own slot, so it keeps them (zero copy)
        # whatever zero_copy says.
        self.summing = not (ctx.box.has_local_view and (options.zero_copy or self.survival.group is not None))
        name, fingerprint = "box-sync-grads", self.layout.fingerprint()
        if self.summing:  # one level, or two across nodes (box/levels.py)
            self.box = BoxMean(
                ctx.box,
                self.world,
                self.slot,
                name,
                layout_hash=fingerprint,
                timeout=ctx.timeout_s,
                bounds=[*self.layout.offsets, numel, self.slot],  # the flags after the gradients
            )
        else:
            self.box = open_box(
                ctx.box,
                self.world,
                2 * n * self.slot,
                name=name,
                layout_hash=fingerprint,
                timeout=ctx.timeout_s,
            )
        self.shared = None if self.summing else self.box.local_view()
        self.mean = torch.zeros(self.slot)
        self.local = torch.zeros(self.slot) if self.shared is None else None
        # This worker's slot of even and odd steps, and the parameters' .grad views into each. On a
        # GPU backward writes a device buffer, copied into the host slot after it (and the mean back).
        device = self.world.device
        self.staged = None if device.type == "cpu" else torch.zeros(self.slot, device=device)
        self.mean_on_device = self.mean if self.staged is None else torch.zeros(self.slot, device=device)
        self.mean_grads = list(self.layout.views(self.mean_on_device[:numel]).values())
        self.slot_of = [self._my_slot(parity) for parity in (0, 1)]
        bound = self.slot_of if self.staged is None else [self.staged, self.staged]
        self.views_of = [list(self.layout.views(s[:numel]).values()) for s in bound]
        # Across nodes (one level), a bucket goes into the box as soon as backward has finished it, as
        # DDP's allreduce starts during backward: the parameters' gradients are laid out in order and
        # backward finishes them roughly last to first, so the finished tail of the slot grows down.
        early = (
            self.summing and ctx.box.backend == "rma" and not self.box.two_level and self.world.world_size > 1
        )
        self.bucket = max(1, int(options.bucket_mb * (1 << 20) / 4)) if options.bucket_mb > 0 else 0
        early = early and self.bucket > 0 and self.staged is None
        self.finishing = FinishedTail([*self.layout.offsets, numel], self.bucket)
        # The average runs at the end of backward (its hooks first, so a pass's early pushes know
        # whether it communicates): .grad is the mean when backward() returns, as with DDP.
        self.passes = BackwardPasses(self, self.params, self._pass_end)
        self.grads = GradViews(  # hooks note who got a gradient
            self.params, self.views_of[0], track=True, on_ready=self._ready if early else None
        )
        self.optimizer = ctx.make_optimizer(self.params)
        if self.survival.joining:
            self.survival.share_state()  # a replacement: the survivors' weights and optimizer state

    def _slots(self, parity: int) -> tuple[int, int]:
        """Offsets of this step's slot area and of this worker's slot in it."""
        area = parity * self.world.world_size * self.slot
        return area, area + self.world.rank * self.slot

    def _my_slot(self, parity: int) -> torch.Tensor:
        _, mine = self._slots(parity)
        return self.shared[mine : mine + self.slot] if self.shared is not None else self.local

    def begin_step(self, step: int) -> None:
        self.survival.admit(step)
        self.step_now = step
        self.finishing.reset()  # the slot's gradients from finishing.cut on are in the box
        self.grad = self.slot_of[step % 2]
        self.grad.zero_()
        if self.staged is not None:
            self.staged.zero_()
        self.grads.views = self.views_of[step % 2]
        self.grads.rebind_()  # backward accumulates here
        self.passes.reset()

    def _pass_end(self, syncs: bool) -> None:
        if syncs and self.passes.synced:
            raise UserError(
                "box-sync: a second backward after one that communicated in the same step; put the "
                "micro-steps before the last inside opt.no_sync()"
            )
        if syncs and self.passes.exchanged:
            raise UserError(
                "box-sync exchanges a step's gradients once, through the box's slot of the step: a "
                "backward exchanged them, the loop zeroed them, and this one would exchange again (the "
                "generator's backward of a GAN went through this model?); freeze the parameters that "
                "backward must not train (requires_grad_(False)), or use allreduce or ps-sync"
            )
        if syncs:
            self._average(self.step_now)

    def _average(self, step: int) -> None:
        """This worker's slot complete, the mean of every worker's (or every member's) into ``.grad``."""
        numel, grad = self.layout.numel, self.grad
        if self.staged is not None:
            grad[:numel].copy_(self.staged[:numel])
        grad[numel:].copy_(torch.tensor(self.grads.used, dtype=grad.dtype))
        if self.summing:
            self._sum_in_box(step)
            self.sync_buffers()
        else:
            self._meet(step, self.survival.group.members if self.survival.group is not None else None)
        self._use_mean()

    def _use_mean(self) -> None:
        if self.staged is not None:
            self.mean_on_device.copy_(self.mean)
        got = self.mean[self.layout.numel :].tolist() if not all(self.grads.used) else None
        for i, (p, view) in enumerate(zip(self.params, self.mean_grads)):
            p.grad = view if got is None or got[i] else None  # no worker computed it: as in one process

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.survival.group is not None and not self.summing:
            # A peer lost in the average at the end of backward (or, where no pass communicated, in
            # the average now) makes the survivors regroup and average the members' slots again.
            first = self.passes.raise_lost if self.passes.synced else lambda: self._average(step)
            again = lambda: self._meet(step, self.survival.group.members)  # noqa: E731
            if self.exchange(first, step, again) is CAUGHT_UP:
                return StepResult(loss_value(loss), samples, self.timers.pop())  # the leader's update
            self._use_mean()
        elif not self.passes.synced:  # every pass inside no_sync, or no backward
            self._average(step)
        self.optimizer.step()
        return StepResult(loss_value(loss), samples, self.timers.pop())

    def _ready(self, i: int, first: bool) -> None:
        """Parameter ``i``'s gradient is complete (one backward a step): push the finished tail of the
        slot once it holds a bucket's worth beyond what is in the box."""
        if not self.passes.syncs:
            return
        bucket = self.finishing.finish(i)
        if bucket is not None:
            _, lo, hi = bucket
            self.box.push_early(self.grad, lo, hi, self.step_now, self.mean)

    def _meet(self, step: int, members: list[int] | None = None) -> None:
        """The barrier, then the average over the slots: every worker's, or in a run that survives in
        place the current ``members``' (their step counters are its barrier)."""
        n, slot = self.world.world_size, self.slot
        with self.timers.phase("barrier"):
            if members is None:
                self.box.barrier()
            else:
                with self.collective("box barrier"):
                    self._arrive_and_wait(step, [r for r in members if r != self.world.rank])
        with self.timers.phase("average"):
            area, _ = self._slots(step % 2)
            slots = self.shared[area : area + n * slot].view(n, slot)
            if members is not None and len(members) < n:
                slots = slots[members]
            torch.sum(slots, dim=0, out=self.mean).mul_(1.0 / len(slots))
        self.sync_buffers()

    def _arrive_and_wait(self, step: int, others: list[int]) -> None:
        """Post this worker's step (its slot is written), then wait for every other member's post;
        ``PeerLost`` as soon as one of them is dead without having posted."""
        box = self.box
        box.set_counter(step_counter(self.world.rank), step + 1)

        def missing() -> list[int]:
            return [r for r in others if box.read_counter(step_counter(r)) <= step]

        def arrived() -> bool:
            late = missing()
            if late and self.survival.group.gone(late):
                # A rank that posted, then died, counts (its slot is whole): a second look, made after
                # the board showed the death, sees every post made before it.
                dead = self.survival.group.gone(missing())
                if dead:
                    raise PeerLost(f"box barrier at step {step}: rank(s) {dead} died")
            return not late

        wait_until(
            arrived,
            self.ctx.timeout_s,
            lambda: (
                f"box barrier at step {step}: ranks {missing()} did not arrive within {self.ctx.timeout_s:g} s"
            ),
        )

    def catch_up(self, src: int, behind: bool, why: str) -> None:
        self.survival.share_state(src, receive=behind, phase="state to a rank a step behind")

    def _sum_in_box(self, step: int) -> None:
        self.box.mean_(self.grad, step, out=self.mean, timers=self.timers)  # its phases: push, barrier, pull

    def close(self) -> None:
        self.passes.close()
        self.grads.close()  # no hooks left on a user's model, which outlives the strategy
        for p in self.params:
            p.grad = None  # drop views into the shared segment before it is unmapped
        self.shared = self.slot_of = self.views_of = self.staged = None
        self.box.close()
