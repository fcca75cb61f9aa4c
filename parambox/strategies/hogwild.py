"""``hogwild`` (Niu, Recht, Ré and Wright 2011): the model lives in the ``shm`` box, updated without locks.

Every worker's parameters are views into one shared-memory segment (``Layout.bind_params_`` on
``box.tensor()``): forward reads the shared weights as they are, and each worker's own optimizer
writes its update into them in place, with no lock and no copy. One node only: the box is local
memory, so ``--box rma`` or a run over several nodes is an error.

Optimizer state (momentum, Adam moments) is each worker's own, in its private memory. With N
workers each applying its own momentum step to the same weights the effective step is about N
times larger, so Hogwild wants a smaller learning rate: the ``digits-hogwild`` preset halves the
default (``--lr 0.015``: final test accuracy 0.967-0.975 over seeds 0-2 here, 2 workers); the default
run's ``--lr 0.03`` gave 0.969, 0.975 and 0.928.

Metrics: ``staleness`` is the number of other workers' steps that landed in the shared weights
while this worker computed its gradient; ``comm.update`` the time of its in-place optimizer step.
Gradients stay per-parameter (``zero_grad(set_to_none=True)``, as plain PyTorch does it), so a
step costs what the PyTorch Hogwild example's costs plus one reduction over the gradient: an
update is applied only when the loss and the gradient are finite, otherwise the worker halts and
leaves the run (the shared weights stay finite). Termination alignment, lost-worker detection and
the step counters are those of every asynchronous strategy (``asynchronous.AsyncStrategy``); the
result is the shared weights once every worker is done, copied out by rank 0.
"""

from __future__ import annotations

import torch

from parambox.errors import UserError
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncOptions, AsyncStrategy
from parambox.strategies.base import Context, StepResult


class HogwildOptions(AsyncOptions):
    """Termination alignment and ``lost_after_s`` only: Hogwild has no knob of its own."""


class Hogwild(AsyncStrategy):
    """Lock-free updates of shared weights. ``parambox train --strategy hogwild --preset digits-hogwild``

    >>> # every worker: loss.backward(); optimizer.step()  -- the optimizer writes into shared memory
    """

    name = "hogwild"
    copies_the_weights = False  # the model's parameters are views into the box itself
    shared_center = True
    # Both workers' steps land on the one shared model: at the run's rate 0.03 it moved twice as far per
    # step, and 3 of 10 default digits runs ended at 0.87-0.95; at half the rate (the studies' lr / N
    # for a shared center), seeds 0-9 reached 0.953-0.981 (two runs of each).
    default_optimizer = {"lr": 0.015}
    Options = HogwildOptions
    box_name = "hogwild"

    def __init__(self, ctx: Context, options: HogwildOptions):
        if not ctx.box.has_local_view:
            raise UserError(
                f"hogwild shares weights in local memory: use --box shm, not --box {ctx.box.backend}"
            )
        if ctx.world.device.type != "cpu":
            raise UserError(
                "hogwild keeps the model in host shared memory: it runs on the CPU (PARAMBOX_DEVICE=cpu)"
            )
        if ctx.world.num_nodes > 1:
            raise UserError(
                f"hogwild runs on one node, this run has {ctx.world.num_nodes}; try easgd or downpour"
            )
        super().__init__(ctx, options)
        # The base wrote rank 0's weights into the box; from now on the box *is* the model.
        self.shared = self.box.tensor()[: self.numel]
        for p in self.params:
            p.grad = None  # per-parameter gradients, as plain PyTorch (no flat buffer to zero)
        self.g = None
        self.layout.bind_params_(self.model, self.shared)
        self.x = self.shared
        self.optimizer = ctx.make_optimizer(self.params)

    def settle_grads(self) -> None:
        """Nothing to move: its optimizer reads each parameter's own ``.grad``."""

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.seen = self.box.read_counter(self.counters.total)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.guard(loss, step):
            if self._grads_finite():
                with self.timers.phase("update"):
                    self.optimizer.step()  # in place, into the shared segment, without a lock
            else:
                self.halt("gradient", step)
        # Staleness: the other workers' steps that landed in the shared weights during this one.
        self.client.staleness = self.box.read_counter(self.counters.total) - self.seen
        return self.step_result(loss, samples)

    def _grads_finite(self) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return True
        # One sum per tensor, then one test: NaN and Inf survive a sum.
        return is_finite(torch.stack([g.sum() for g in grads]))

    def load_model_state(self, model_state: dict[str, torch.Tensor]) -> None:
        """Resume: the shared weights come back from rank 0's saved center (``load_state_dict``);
        a worker writing its own snapshot into them would race with it. Buffers are per worker."""
        names = {n for n, _ in self.model.named_parameters()}
        buffers = {k: v for k, v in model_state.items() if k not in names}
        self.model.load_state_dict(buffers, strict=False)

    def close(self) -> None:
        for p in self.params:
            p.grad = None
        self.shared = None
        self.box.close()  # the parameters keep the mapping alive until the model goes
