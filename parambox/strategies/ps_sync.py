"""``ps-sync``: a synchronous parameter server on rank 0 (SHM-Learn-Dist §6).

Each step rank 0 gathers every worker's gradient, averages them, applies its optimizer and
broadcasts the new weights. The time of gather, average and broadcast is recorded per step
(the report's Figs. 6.4-6.6).

Each gathered gradient ends with one flag per parameter ("this rank computed its gradient"): a
parameter no rank computed a gradient for in a step has ``.grad = None`` on the server, so its
optimizer leaves it alone, as in one process. Frozen parameters are not exchanged. Buffers
(batch-norm statistics) are rank 0's, broadcast before each forward pass, as DDP does.

The gather runs at the end of each backward pass outside ``no_sync``. A second such pass in a step
(PyTorch's DCGAN example: the real and the fake loss) gathers again, as DDP averages again: each rank
sends everything it accumulated in the step, so the server's ``.grad`` is the mean of the sums.

In a run that survives in place the server is the group's leader: when rank 0 dies the oldest
survivor serves, from the weights of the last broadcast, with an optimizer of its own whose state
(momentum) starts over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.utils import vector_to_parameters

from parambox.runtime.survival import CAUGHT_UP
from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value
from parambox.strategies.grads import BackwardPasses
from parambox.strategies.tensors import flatten, trainable


class ParameterServerSync(Strategy):
    name = "ps-sync"
    float32_weights = False  # the parameters as they are
    comm_topology = "ps"  # perfmodel's: rank 0's link carries every gradient in and every copy out (pick)
    survives_in_place = True  # the server too: the oldest survivor serves, with a fresh optimizer
    optimizer_on_every_rank = False  # the server's alone

    def __init__(self, ctx: Context, options: Options):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        if self.survival.joining:  # a replacement: the server's weights (share_state sends the model)
            self.survival.share_state()
        self.flat = flatten(self.params).detach()
        if self.world.world_size > 1 and not self.survival.joining:
            dist.broadcast(self.flat, src=0)
            vector_to_parameters(self.flat, self.params)
            self.sync_buffers()
        if self.leads:  # only the server holds an optimizer
            self.optimizer = ctx.make_optimizer(self.params)
        # The gather runs at the end of backward: the server's .grad is the mean when backward() returns,
        # so a clip between backward and step clips what the server applies, as in one process.
        self.passes = BackwardPasses(self, self.params, self._pass_end)
        self.grad: torch.Tensor | None = None  # this rank's gradients and flags, kept for a repeat
        self.served: torch.Tensor | None = None  # the server's last mean, as its .grad was given it

    def begin_step(self, step: int) -> None:
        for p in self.params:
            p.grad = None
        self.passes.reset()
        self.stepped = False
        self.survival.admit(step)

    def _local_grad(self) -> torch.Tensor:
        got = torch.tensor([p.grad is not None for p in self.params], dtype=self.flat.dtype)
        return torch.cat(
            [
                _dense(p.grad).reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                for p in self.params
            ]
            + [got.to(self.flat.device)]
        )

    def _pass_end(self, syncs: bool) -> None:
        if not syncs:
            return
        local = self._local_grad()
        if self.passes.synced:
            # Another communicating pass of the step (the DCGAN example's real and fake passes, as DDP
            # takes them): this rank's gradient is what it sent plus what accumulated since, and the
            # server's .grad holds the mean it was given, not its own; the mean is gathered afresh.
            n = self.flat.numel()
            if self.leads:
                local[:n] += self.grad[:n] - self.served
            local[n:] = torch.maximum(local[n:], self.grad[n:])
        self.grad = local
        self._gather(self.grad)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.passes.synced:  # gathered at the end of backward: a peer lost then is answered here
            fn = lambda: (self.passes.raise_lost(), self._step_broadcast())  # noqa: E731
        else:  # every pass inside no_sync, or no backward
            self.grad = self._local_grad()
            fn = lambda: self._gather_step_broadcast(self.grad)  # noqa: E731
        # One sequence on every rank, also when repeated over the survivors after a lost worker:
        # gather the gradients (each rank's kept), the server steps once, broadcast the weights.
        if self.exchange(fn, step, again=lambda: self._gather_step_broadcast(self.grad)) is CAUGHT_UP:
            self.flat = flatten(self.params).detach()  # the leader's, this step's update made
        elif not self.leads:
            vector_to_parameters(self.flat, self.params)
        return StepResult(loss_value(loss), samples, self.timers.pop())

    def catch_up(self, src: int, behind: bool, why: str) -> None:
        """The leader's weights (and, from the server, its optimizer) to the ranks a step behind: a
        worker whose broadcast failed, or the server whose broadcast to the dead rank failed after a
        worker had its copy (the server has stepped then: it keeps its own optimizer)."""
        self.survival.share_state(src, receive=behind, phase="weights to a rank a step behind")

    def _gather_step_broadcast(self, grad: torch.Tensor) -> None:
        self._gather(grad)
        self._step_broadcast()

    def _gather(self, grad: torch.Tensor) -> None:
        """Every rank's gradients to the server, whose ``.grad`` becomes their mean."""
        server = self.leads
        with self.timers.phase("gather"), self.collective("gradient gather"):
            if self.world.world_size > 1:
                inbox = [torch.empty_like(grad) for _ in range(dist.get_world_size())] if server else None
                dist.gather(grad, inbox, dst=0, async_op=True).wait()
            else:  # one worker (a scaling study's baseline): no process group, the server is the worker
                inbox = [grad]
        if server and not self.stepped:  # a repeat after a failed broadcast does not step twice
            with self.timers.phase("average"):
                mean = torch.stack(inbox).mean(dim=0)
                self.served = mean[: self.flat.numel()].clone()  # (.grad accumulates into its views)
                offset, got = 0, mean[self.flat.numel() :].tolist()
                for p, anyone in zip(self.params, got):  # no rank computed it: as in one process
                    p.grad = mean[offset : offset + p.numel()].view_as(p) if anyone else None
                    offset += p.numel()

    def _step_broadcast(self) -> None:
        """The server steps once; its weights to every rank."""
        if self.leads and not self.stepped:
            if self.optimizer is None:  # the server died: a survivor serves, its momentum starts over
                self.optimizer = self.ctx.make_optimizer(self.params)
            self.optimizer.step()
            self.stepped = True
            self.flat = flatten(self.params).detach()
        with self.timers.phase("broadcast"), self.collective("weight broadcast"):
            if self.world.world_size > 1:
                dist.broadcast(self.flat, src=0, async_op=True).wait()
        self.sync_buffers()  # rank 0's batch-norm statistics, inside the exchange (see Strategy.sync_buffers)

    def close(self) -> None:
        self.passes.close()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense one the gather sends."""
    return grad.to_dense() if grad.is_sparse else grad
