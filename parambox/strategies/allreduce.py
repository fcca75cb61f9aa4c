"""``allreduce``: synchronous gradient averaging (SHM-Learn-Dist Eq. 2.1), DDP/Horovod style.

Gradients are bucketed in reverse parameter order (the order backward produces them) and each
bucket's allreduce starts as soon as its last gradient has been accumulated, overlapping
communication with the rest of backward. The parameters' ``.grad`` are views into the bucket
buffers, so no gradient is copied before or after communication.

As with DDP, the allreduces are waited for at the end of backward (an autograd callback): when
``backward()`` returns, ``.grad`` holds the averaged gradient, so clipping, ``GradScaler.unscale_``
and inf checks between backward and the optimizer step see what one process would. Gradient
accumulation: backward passes inside ``no_sync()`` (or the first ``backward_passes_per_step - 1``
of a step) accumulate locally and communicate nothing; the next backward averages the sum. A
backward outside ``no_sync()`` after an averaged one averages again, which is the same sum
(averaging is linear), as with DDP.

Any module: frozen parameters are not in the buckets (never moved, not even by weight decay);
tied weights appear once. Each bucket ends with one flag per parameter saying "this rank computed
its gradient", summed by the same allreduce: a parameter no rank computed a gradient for in a step
(an unused branch) has ``.grad = None`` when the optimizer steps, so momentum and weight decay leave
it alone, as in one process. Buffers (batch-norm statistics) are rank 0's, broadcast before each
forward pass, as DDP does.

``compression`` (int8, topk, sign, ..., or powersgd with ``powersgd_rank``): the buckets still gather the
gradients during backward, but nothing is sent then; at the end of a pass that communicates, the flat
gradient (every bucket, then the flags, which ride along exact) is exchanged once, compressed with error
feedback (:class:`~parambox.strategies.exchange.SumExchange`'s gather-and-sum, or
:class:`~parambox.strategies.powersgd.PowerSGD`'s two allreduces), and decoded into the buckets: when
``backward()`` returns ``.grad`` holds the averaged, decompressed gradient, as without. The error a rank
owes is its own and is in its checkpoint (``compression.error``); PowerSGD's Q is the run's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field

from parambox.runtime.elastic import PeerLost
from parambox.runtime.survival import CAUGHT_UP
from parambox.strategies.base import Context, StepResult, Strategy, check_float32, loss_value
from parambox.strategies.exchange import CompressionOptions, LowRankOptions, SumExchange
from parambox.strategies.grads import BackwardPasses, GradViews
from parambox.strategies.powersgd import PowerSGD
from parambox.strategies.tensors import trainable


class AllReduceOptions(CompressionOptions, LowRankOptions):
    bucket_mb: float = Field(25.0, gt=0, description="bucket size in MB")
    first_bucket_mb: float = Field(1.0, gt=0, description="a small first bucket starts communication early")


class _Bucket:
    """Gradients of some parameters back to back, then one "got a gradient" flag per parameter; in
    the parameters' dtype (bf16 parameters: a bf16 allreduce, as DDP's)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel + len(params), device=params[0].device, dtype=params[0].dtype)
        self.flags = self.buffer[numel:]
        views, offset = [], 0
        for p in params:
            views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.views = views
        self.grads: GradViews | None = None
        self.ready = 0  # parameters whose gradient this backward pass has accumulated
        self.this_pass = [False] * len(params)
        self.work: dist.Work | None = None
        self.local: torch.Tensor | None = None  # this rank's gradients, kept where a step may be repeated


def build_buckets(params: list[torch.nn.Parameter], bucket_mb: float, first_mb: float) -> list[_Bucket]:
    """Group parameters (in the order given) into buckets of about ``bucket_mb``, one dtype a bucket;
    the first is smaller."""
    buckets, current, size = [], [], 0
    limit = first_mb * 2**20
    for p in params:
        if current and p.dtype != current[0].dtype:
            buckets.append(_Bucket(current))
            current, size, limit = [], 0, bucket_mb * 2**20
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(_Bucket(current))
            current, size, limit = [], 0, bucket_mb * 2**20
    if current:
        buckets.append(_Bucket(current))
    return buckets


class AllReduce(Strategy):
    name = "allreduce"
    Options = AllReduceOptions
    float32_weights = False  # buckets in the parameters' dtype; a compressed exchange is float32 (checked)
    takes_sharded_optimizer = True  # ZeroRedundancyOptimizer: the averaged gradient on every rank, as DDP's
    survives_in_place = True
    per_rank_state = ("compression.error",)  # the error feedback a rank owes is its own

    def __init__(self, ctx: Context, options: AllReduceOptions):
        super().__init__(ctx, options)
        params = trainable(self.model)
        self.distributed = self.world.world_size > 1 and dist.is_initialized()
        if self.distributed and not self.survival.joining:
            for t in [*params, *self.model.buffers()]:  # same start everywhere, whatever the seeds did
                dist.broadcast(t.data, src=0)
        self.passes = BackwardPasses(self, params, self._pass_end)  # first: its hooks run before the buckets'
        self.buckets = build_buckets(list(reversed(params)), options.bucket_mb, options.first_bucket_mb)
        for b in self.buckets:
            b.grads = GradViews(b.params, b.views, track=True, on_ready=self._ready_in(b))
        self.optimizer = ctx.make_optimizer(params)
        if options.compression != "none":
            check_float32(f"allreduce with compression={options.compression}", self.model)
        self.compressed = self._compression(options) if self.distributed else None
        self.sent_bytes = 0  # this step's compressed messages
        if self.survival.joining:
            self.survival.share_state()  # a replacement: the survivors' weights and optimizer state
            if self._owed() is not None:
                self._owed().zero_()  # the error it owes is its own: none yet

    def _owed(self) -> torch.Tensor | None:
        """The error feedback this rank owes (None without compression)."""
        if isinstance(self.compressed, PowerSGD):
            return self.compressed.error
        return None if self.compressed is None else self.compressed.compressor.error

    def _compression(self, options: AllReduceOptions) -> PowerSGD | SumExchange | None:
        """The encoder of the flat gradient (the buckets' gradients, then their flags), or None."""
        flags = sum(len(b.params) for b in self.buckets)
        device = self.buckets[0].buffer.device if self.buckets else None
        if options.compression == "powersgd":
            shapes = [p.shape for b in self.buckets for p in b.params]
            return PowerSGD(shapes, options.powersgd_rank, device)
        if options.compression == "none":
            return None
        numel = sum(b.buffer.numel() - len(b.params) for b in self.buckets)
        return SumExchange(
            numel,
            flags,
            self.world.world_size,
            options.compression,
            options.compression_block,
            device,
            ratio=options.compression_ratio,
        )

    def _ready_in(self, b: _Bucket):
        def on_ready(i: int, first: bool) -> None:
            if b.this_pass[i]:
                return
            b.this_pass[i] = True
            b.ready += 1
            if (
                b.ready == len(b.params)
                and self.passes.syncs
                and self.distributed
                and self.compressed is None
            ):
                self._start(b)

        return on_ready

    def _pass_end(self, syncs: bool) -> None:
        """The end of a backward pass: one that communicates waits for its allreduces, so that ``.grad``
        is averaged when ``backward()`` returns."""
        for b in self.buckets:
            b.ready, b.this_pass = 0, [False] * len(b.params)
        if syncs and self.distributed:
            with self.timers.phase("allreduce_wait"):
                self._wait_all()

    def begin_step(self, step: int) -> None:
        for b in self.buckets:  # zero in place: .grad must stay views into the buckets
            b.buffer.zero_()
            b.ready, b.work, b.this_pass = 0, None, [False] * len(b.params)
            b.grads.rebind_()
        self.passes.reset()
        self.sent_bytes = 0
        self.survival.admit(step)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        partial = [b for b in self.buckets if not all(b.grads.used)]
        caught_up = False
        if self.distributed:
            with self.timers.phase("allreduce_wait"):
                # Averaged at the end of backward (the usual case): only a peer lost meanwhile is left
                # to answer; otherwise (every pass inside no_sync) the allreduce runs now.
                fn = self.passes.raise_lost if self.passes.synced else self._wait_all
                caught_up = self.exchange(fn, step, again=self._reduce_again) is CAUGHT_UP
        if not caught_up:  # (caught up: the leader's weights and optimizer have this step's update)
            for b in partial:  # a rank whose every parameter got a gradient has no flag to read
                b.grads.drop_unused_(b.flags.tolist() if self.distributed else b.grads.used)
            self.optimizer.step()
        result = StepResult(loss_value(loss), samples, self.timers.pop())
        if self.compressed is not None and self.sent_bytes:
            result.extra["exchange_bytes"] = float(self.sent_bytes)
        return result

    def _start(self, b: _Bucket) -> None:
        # "this rank computed the gradient", per parameter, over every pass of the step so far
        b.flags.copy_(torch.tensor(b.grads.used, dtype=b.flags.dtype))
        if (
            self.survival.group is not None
        ):  # the allreduce is in place: keep the input, to repeat it if a peer dies
            b.local = b.buffer.clone()
        b.work = dist.all_reduce(b.buffer, async_op=True)

    def _wait_all(self) -> None:
        if self.compressed is not None:
            self._exchange_compressed()
            return
        try:
            with self.collective("gradient allreduce"):
                for b in self.buckets:
                    if b.work is None:
                        self._start(b)
                    b.work.wait()
        except PeerLost:
            for b in self.buckets:  # every bucket's allreduce ends (failed) before the group goes
                if b.work is not None:
                    with contextlib.suppress(Exception):
                        b.work.wait()
                    b.work = None
            raise
        for b in self.buckets:
            # A finished Work kept alive holds the group (a regroup's destroy would leave it open) and,
            # past destroy_process_group, can abort the process.
            b.work = None
            b.buffer.div_(self.survival.group_size)
        self.sync_buffers()

    def _exchange_compressed(self, again: bool = False) -> None:
        """The flat gradient summed over the group, compressed, decoded into the buckets and averaged;
        ``again``: the kept round once more, over the survivors."""
        keep = self.survival.group is not None
        flat = torch.cat([b.buffer[: b.buffer.numel() - len(b.params)] for b in self.buckets])
        flags = torch.cat([torch.tensor(b.grads.used, dtype=torch.float32) for b in self.buckets]).to(
            flat.device
        )
        with self.collective("gradient allreduce"):
            if isinstance(self.compressed, PowerSGD):
                reduce = lambda t: dist.all_reduce(t, async_op=True).wait()  # noqa: E731
                n = self.survival.group_size
                if again:
                    total, flags = self.compressed.redo(flags, reduce, n)
                else:
                    total, flags = self.compressed.reduce(flat, flags, reduce, n, keep=keep)
                sent = self.compressed.bytes_sent
            else:
                if again:
                    self.compressed.redo()
                else:
                    self.compressed.start(flat, flags, keep=keep)
                total, flags = self.compressed.wait()
                sent = self.compressed.bytes_sent
        self.sent_bytes += sent
        offset = cut = 0
        for b in self.buckets:
            n = b.buffer.numel() - len(b.params)
            b.buffer[:n].copy_(total[offset : offset + n])
            b.flags.copy_(flags[cut : cut + len(b.params)])
            b.buffer.div_(self.survival.group_size)
            offset, cut = offset + n, cut + len(b.params)
        self.sync_buffers()

    def _reduce_again(self) -> None:
        """The step's allreduce once more, over the survivors, from the gradients each rank kept."""
        if self.compressed is not None:
            self._exchange_compressed(again=True)
            return
        with self.collective("gradient allreduce"):
            for b in self.buckets:
                b.buffer.copy_(b.local)
                dist.all_reduce(b.buffer, async_op=True).wait()
        for b in self.buckets:
            b.buffer.div_(self.survival.group_size)
        self.sync_buffers()

    def catch_up(self, src: int, behind: bool, why: str) -> None:
        owed = self._owed()
        kept = None if owed is None else owed.clone()
        self.survival.share_state(src, receive=behind, phase="state to a rank a step behind")
        if owed is not None:  # the leader's state, but this rank's own error feedback
            owed.copy_(kept)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if isinstance(self.compressed, PowerSGD):
            state["compression"] = self.compressed.state_dict()
        elif self._owed() is not None:
            state["compression"] = {"error": self._owed().clone()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("compression", {})
        if isinstance(self.compressed, PowerSGD):
            self.compressed.load_state_dict(saved)
        elif self._owed() is not None and "error" in saved:
            self._owed().copy_(saved["error"])

    def close(self) -> None:
        self.passes.close()
        for b in self.buckets:
            b.grads.close()
