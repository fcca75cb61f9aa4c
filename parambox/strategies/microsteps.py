"""The loop's training features inside one step of a data-parallel rule: gradient accumulation over
micro-batches, autocast (bf16, fp16), the fp16 loss scaler and gradient clipping.

:meth:`Strategy.step <parambox.strategies.base.Strategy.step>` runs :func:`run_step`: the rule's
``begin_step``, the forward and backward passes of the batch's ``ctx.grad_accum`` micro-batches, the
scaler's unscaling and overflow check and the clipping, then the rule's ``end_step`` with the batch's
mean loss. The gradient is the batch's mean gradient, as one backward of the whole batch would give it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parambox.runtime.survival import CAUGHT_UP
from parambox.strategies.tensors import batch_size, map_tensors, trainable

if TYPE_CHECKING:
    from parambox.strategies.base import StepResult, Strategy


def run_step(strategy: Strategy, batch: Any, step: int) -> StepResult:
    """One step of ``strategy`` on this worker's ``batch`` (already on the device), with the loop's
    features of ``strategy.ctx``: ``begin_step``, the micro-batches' forward and backward passes,
    unscaling (fp16) and clipping, then ``end_step`` (at rate 0 where the scaler skips the step)."""
    strategy.begin_step(step)
    n = batch_size(batch)
    loss = forward_backward(strategy, batch, n)
    finite, extra = before_update(strategy, step)
    pause = strategy.ctx.pause_rates
    with pause() if not finite and pause is not None else nullcontext():
        result = strategy.end_step(loss, n, step)
    result.extra.update(extra)
    return result


def forward_backward(strategy: Strategy, batch: Any, n: int) -> torch.Tensor:
    """Each micro-batch's forward and loss (under :func:`autocast`) and the backward of its share of
    the loss (scaled, fp16), inside the rule's ``no_sync`` but for the last; the batch's mean loss."""
    ctx = strategy.ctx
    parts = split_batch(batch, ctx.grad_accum, n)
    # Nothing may run between the last backward and the update when a strategy updates during
    # backward (downpour's buckets): it gets before_backward only when there is nothing to run.
    direct = not ctx.grad_clip and ctx.scaler is None
    total: torch.Tensor | None = None  # the batch's mean loss: the parts' losses by their shares
    for i, (part, share) in enumerate(parts):
        last = i == len(parts) - 1
        with strategy.no_sync() if not last else nullcontext():
            with autocast(ctx.precision, strategy.world.device):
                loss = ctx.loss_fn(strategy.model, part)
            if len(parts) == 1:
                total = loss.detach()
            else:
                loss = loss * share
                total = loss.detach().float() if total is None else total + loss.detach().float()
            if last and direct:
                strategy.before_backward(total)
            if ctx.loss_weight != 1.0:  # uneven slices of a resized run: the ranks' mean is the batch's
                loss = loss * ctx.loss_weight
            (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
    return total


def before_update(strategy: Strategy, step: int) -> tuple[bool, dict[str, float]]:
    """Between the last backward and the update: the loss scaler's unscaling and overflow check, and
    clipping. (Whether the update may go ahead, the step record's additions.)"""
    ctx = strategy.ctx
    extra: dict[str, float] = {}
    if ctx.scaler is not None:
        extra["loss_scale"] = float(ctx.scaler.get_scale())
        grads = _Grads(trainable(strategy.model))
        agree_on_overflow(strategy, grads.params, step)
        ctx.scaler.unscale_(grads)
    if ctx.grad_clip:
        # What .grad holds after the last backward: the averaged gradient where the strategy has
        # averaged it by then, the local one in strategies that step locally.
        extra["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(trainable(strategy.model), ctx.grad_clip))
    if ctx.scaler is None:
        return True, extra
    finite = ctx.scaler.step(grads) is not None  # None: an inf or NaN, the scaler skips the step
    ctx.scaler.update()
    if not finite:  # the update runs (its exchanges too) with zero gradients at rate 0
        extra["skipped"] = 1.0
        for p in grads.params:
            if p.grad is not None:
                p.grad.zero_()
    return finite, extra


def agree_on_overflow(strategy: Strategy, params: list[nn.Parameter], step: int) -> None:
    """fp16, a strategy whose ranks run in lockstep over several ranks: an inf or NaN in any rank's
    gradient skips the step on every rank, as DDP's averaged gradient makes it (one allreduce of a
    flag; a rank whose own gradients are finite gets a NaN in one, for its scaler to find), so the
    replicas and the loss scales stay the same everywhere."""
    if not (strategy.lockstep and strategy.world.world_size > 1 and dist.is_initialized()):
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def agree() -> bool:
        flag = torch.tensor([0.0 if finite else 1.0], device=grads[0].device)
        with strategy.collective("loss scaler's overflow check"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait()
        return bool(flag.item())

    overflow = strategy.exchange(agree, step)
    if overflow is not CAUGHT_UP and overflow and finite:
        grads[0].fill_(float("nan"))


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """Forward and loss at ``precision``: autocast to bf16 or fp16 (the weights, gradients and every
    exchange stay fp32); nothing for fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def split_batch(batch: Any, k: int, n: int | None = None) -> list[tuple[Any, float]]:
    """``batch`` in ``k`` micro-batches along dim 0 (as equal as they come: ``torch.tensor_split``),
    each with its share of the samples; tensors whose first dimension is not the batch's ``n``
    samples go whole into every part. Fewer parts where the batch has fewer than ``k`` samples.

    >>> [(x.tolist(), s) for (x, _), s in split_batch((torch.arange(4), torch.zeros(())), 2)]
    [([0, 1], 0.5), ([2, 3], 0.5)]
    """
    n = batch_size(batch) if n is None else n
    k = max(1, min(k, n))
    if k == 1:
        return [(batch, 1.0)]
    sizes = [len(r) for r in torch.arange(n).tensor_split(k)]
    starts = [sum(sizes[:i]) for i in range(k)]

    def part(i: int) -> Any:
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.narrow(0, starts[i], sizes[i]) if t.dim() > 0 and len(t) == n else t

        return map_tensors(cut, batch)

    return [(part(i), sizes[i] / n) for i in range(k)]


class _Grads(torch.optim.Optimizer):
    """The trainable parameters as an optimizer that moves nothing: what a ``GradScaler`` unscales
    and checks. ``scaler.step(_Grads(...))`` is True where the gradients are finite, None where the
    scaler skips the step."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        super().__init__(params, {})

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        return True
