"""``downpour``: asynchronous SGD against the center weights in the box (DistBelief's Downpour SGD).

Every ``n_fetch`` steps a worker pulls ``x <- c``; each step it applies its local optimizer
(``x <- x - eta g`` with plain SGD) and accumulates the update ``a <- a - eta g``; every ``n_push``
steps it pushes ``c <- c + a`` and resets ``a``. The accumulated update is measured as the
replica's change since the last exchange, so any local optimizer (momentum included) works and
one flat subtraction yields ``a``.

``adagrad``: DistBelief's per-parameter rate ``eta_j = gamma / sqrt(sum of g_j^2)``, the sums of
squared gradients of every worker kept in the box next to ``c`` (the box only accumulates them;
each worker computes its rate from the sums it pulled plus its own unpushed squares).
``warmup_steps``: rank 0 trains alone for that many steps before the others start (warm start).
``overlap`` (with ``n_fetch == n_push``): the push and the fetch that follows it run in the
background while the next steps compute; the fetched center arrives one exchange late and the
worker's own steps since are re-applied on it (``x <- c + (x - x_pushed)``). Across nodes the link
then hides behind the compute, as Streaming DiLoCo's overlap does for its outer step.

``bucket_mb`` (where the center is remote and a push and the next fetch go as one push-pull: the
rma box across nodes, one worker a node): each bucket of parameters backward has finished is stepped
by the local optimizer and push-pulled at once, while backward goes on with the earlier layers, as
DDP's allreduce starts during backward. DistBelief's parameter server is sharded and its shards act
independently of one another (Dean et al. 2012, Sec. 4.1), so a worker's exchanges with different
parts of the model need not happen at one moment; each bucket is one whole push-pull. The optimizer
steps each bucket's parameters alone (``strategies/grads.py: step_only``); a bucket whose update is
not finite is not pushed, and the worker halts at the step's end (the buckets pushed before it were
finite). Only in the steps parambox drives (``before_backward`` saw a finite loss): a
``DistributedOptimizer`` user's backward pushes after it.

``compression`` (``bf16``, ``int8``, ``int4``, ``int2``, ``sign``, ``topk``; ``compression_block``,
``compression_ratio``: :class:`~parambox.strategies.compress.Compressor`'s encodings): each push is
encoded on the worker with error feedback, ``e <- e + a; send Q(e); e <- e - D(Q(e))``, and the
center receives ``D(Q(e))``: what one push leaves out goes with the next ones (the decoded pushes plus
the error still owed sum to the updates made). The center stays float32 and so does what a pull
brings back. Who decodes (``ParameterBox.push_encoded_async``): on the rma box's memory server
(``box.server``, the default across nodes) the codes cross the link, one message a shard
(``PushEncoder`` over ``code_pieces``; topk keeps ``ratio`` of each shard), and the server decodes and
adds them; on ``shm`` the worker decodes and adds float32 into shared memory itself (no link); over
MPI windows (``box.server=false``) and through a node's cache (``box.two_level``: the node's sum
crosses) the worker decodes and float32 crosses, which a warning says. The error is this worker's
own: in its checkpoints (``downpour.error``), so it survives a resume, and kept in memory by the
workers that go on when another is lost; a replacement of a dead worker starts with none (its
predecessor's error, like its unpushed steps, died with it). With compression a push is encoded
whole after backward (no ``bucket_mb`` buckets during backward). ``powersgd`` is refused (it needs
an allreduce of every worker's gradient). Adagrad's squared sums go as float32.

As the rule says, a pull replaces the replica, also its own steps not yet pushed: with
``n_fetch < n_push`` and momentum a worker keeps re-taking those steps and overshoots (0.57 test
accuracy on the default run with fetch 2 / push 4; 0.95 with --momentum 0). Adagrad wants a smaller
rate than SGD here: ``--lr 0.01`` (preset ``digits-downpour-adagrad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from parambox.box import VERSION_COUNTER
from parambox.box.base import Handle, wait_until
from parambox.box.node_cache import NodeCachedBox
from parambox.errors import CommTimeout, warn
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncOptions, AsyncStrategy
from parambox.strategies.base import Context, StepResult
from parambox.strategies.center import CenterClient
from parambox.strategies.compress import PushEncoder
from parambox.strategies.exchange import Background, CompressionOptions, box_encoder
from parambox.strategies.grads import FinishedTail, GradViews, step_only

ADAGRAD_EPS = 1e-10


class DownpourOptions(AsyncOptions, CompressionOptions):
    n_fetch: int = Field(1, ge=1, description="pull the center weights every n_fetch steps")
    n_push: int = Field(1, ge=1, description="push the accumulated update every n_push steps")
    adagrad: bool = Field(False, description="per-parameter Adagrad rates from squared sums kept in the box")
    warmup_steps: int = Field(0, ge=0, description="rank 0 trains alone this many steps first")
    overlap: bool = Field(
        False, description="push and fetch in the background; the center arrives one exchange late"
    )
    bucket_mb: float = Field(
        1.0,
        ge=0,
        description="across nodes: push-pull each finished bucket of this size during backward; "
        "0: the whole update after backward",
    )

    @field_validator("compression")
    @classmethod
    def _per_worker(cls, mode: str) -> str:
        if mode == "powersgd":
            raise ValueError(
                "powersgd needs an allreduce of every worker's gradient at once; a downpour push is one "
                "worker's: choose bf16, int8, int4, int2, sign or topk"
            )
        return mode

    @model_validator(mode="after")
    def _overlap_fetches_at_push(self) -> DownpourOptions:
        if self.overlap and (self.n_fetch != self.n_push or self.adagrad):
            raise ValueError("downpour.overlap needs n_fetch == n_push and no adagrad")
        return self


class DownpourWorker:
    """Downpour's bookkeeping on flat tensors: fetch every ``n_fetch``, push the accumulation every ``n_push``.

    >>> w = DownpourWorker(client, x, n_fetch=1, n_push=2)  # doctest: +SKIP
    >>> w.before_step(0); x -= lr * g; ok = w.after_step(0)  # ... ok is False if a was not finite
    """

    def __init__(
        self,
        client: CenterClient,
        x: torch.Tensor,
        n_fetch: int,
        n_push: int,
        damped: bool = False,
        fuse: bool = False,
        background: Background | None = None,
        encoder: PushEncoder | None = None,
    ):
        self.client, self.x, self.n_fetch, self.n_push, self.damped = client, x, n_fetch, n_push, damped
        # ``downpour.compression``: each push encoded with error feedback (``CenterClient.push_encoded``)
        self.encoder = encoder
        self.acc = torch.zeros_like(x)  # a: the local update not yet pushed
        self.snap = x.clone()  # x right after the last exchange; a = acc + (x - snap)
        self.acc_live = False  # acc holds something (a pull came between two pushes)
        # A push followed at once by the next step's fetch goes as one push-pull request.
        self.fuse, self.fetched_for = fuse, -1
        # overlap: the exchange in flight, the update it carries and the center it brings back
        self.background = background
        self.sending = torch.empty_like(x) if background is not None else None
        self.pulled = torch.empty_like(x) if background is not None else None
        self.waited = 0.0  # seconds the steps blocked on the background exchange

    def before_step(self, step: int) -> None:
        if step % self.n_fetch == 0 and self.fetched_for != step:
            # Step ``step - 1`` ended with a push iff ``step % n_push == 0``: then x == snap and
            # there is nothing to keep (one pass over the buffers saved).
            self.fetch(keep=step % self.n_push != 0)

    def after_step(self, step: int, upto: int | None = None, parts: Sequence[Handle] = ()) -> bool:
        """After the local step: push (and fetch) if the periods say so. ``upto``, ``parts``: the
        buckets from ``upto`` on were sent during backward (``exchange_part``, a fused push-pull)."""
        if (step + 1) % self.n_push:
            return True
        if self.background is not None:
            self.fetched_for = step + 1
            return self.exchange_in_background()
        fetch_next = self.fuse and (step + 1) % self.n_fetch == 0
        ok = self.push(fetch=fetch_next, upto=upto, parts=parts)
        if ok and fetch_next:
            self.fetched_for = step + 1
        return ok

    def send(self, update: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """``c <- c + update`` (``out``: then ``out <- c``, one request); with compression the decoded
        message ``D(Q(e + update))``, ``e <- e + update - D(Q(e + update))``. False, moving nothing and
        the error untouched, if ``update`` is not finite."""
        client = self.client
        if self.encoder is not None:
            return client.push_encoded(self.encoder, update, out)
        if out is None:
            return client.push(update, damped=self.damped)
        return client.push_pull(update, out, damped=self.damped)

    def exchange_part(self, lo: int, hi: int) -> Handle | None:
        """Start ``c[lo:hi] <- c[lo:hi] + (x - snap)[lo:hi]`` and ``x[lo:hi] <- c[lo:hi]`` (a bucket of
        a fused push-pull, sent during backward); None, sending nothing, if its update is not finite."""
        assert self.encoder is None, "a compressed push encodes the whole update at once"
        part = torch.sub(self.x[lo:hi], self.snap[lo:hi], out=self.acc[lo:hi])
        if not is_finite(part):
            return None
        return self.client.box.push_pull_async(part, self.x[lo:hi], 1.0, self.client.start + lo)

    def fetch(self, keep: bool = True) -> None:
        """``x <- c``, keeping the local update made since the last exchange in ``acc`` (``keep``:
        steps were taken since the last push; any fetch between two pushes must keep them, or
        they never reach the center)."""
        if keep:
            self.acc.add_(self.x).sub_(self.snap)
            self.acc_live = True
        self.client.pull(self.x)
        self.snap.copy_(self.x)

    def settle(self) -> None:
        """Wait for the exchange in flight; ``x <- c + (x - x_pushed)``: the center it brought back,
        with this worker's steps since the push re-applied."""
        if self.background is not None and self.background.busy:
            self.waited += self.background.wait()
            self.x.add_(self.pulled).sub_(self.snap)
            self.snap.copy_(self.pulled)

    def exchange_in_background(self) -> bool:
        """Settle the last exchange, then start pushing ``x - x_last`` and fetching ``c`` (the box
        directly: the step's timers are not the thread's); False, starting nothing, if not finite."""
        self.settle()
        torch.sub(self.x, self.snap, out=self.sending)
        if not is_finite(self.sending):
            return False
        self.snap.copy_(self.x)
        client, damped, encoder = self.client, self.damped, self.encoder
        # encoded here, not in the thread: the error is the worker's state (a checkpoint's)
        messages = None if encoder is None else encoder.encode(self.sending)

        def task() -> None:
            box = client.box
            version = box.add_counter(VERSION_COUNTER, 1)
            scale = 1.0 / (version - client.pulled_version + 1) if damped else 1.0
            if messages is None:
                box.push_pull(self.sending, self.pulled, scale, client.start)
            else:  # the center takes the decoded messages; x keeps its own steps
                n = self.sending.numel()
                box.push_encoded_async(
                    messages, n, encoder.code, encoder.params, scale, client.start, self.pulled
                ).wait()
            client.pulled_version = version + 1

        self.background.start(task)
        return True

    def push(self, fetch: bool = False, upto: int | None = None, parts: Sequence[Handle] = ()) -> bool:
        """``c <- c + a`` (scaled by ``1/(s+1)`` when damped); False, pushing nothing, if ``a`` is not finite.
        ``fetch``: then ``x <- c``, in the same box request; ``upto``, ``parts``: only ``[0, upto)``
        is left, the rest on its way in ``parts`` (a fused push-pull without accumulation)."""
        if parts:
            assert fetch and not self.acc_live, "buckets sent early are a fused push-pull's"
            rest = torch.sub(self.x[:upto], self.snap[:upto], out=self.acc[:upto])
            ok = self.client.push_pull(rest, self.x[:upto], parts=parts)
        else:
            if self.acc_live:
                self.acc.add_(self.x).sub_(self.snap)
            else:
                torch.sub(self.x, self.snap, out=self.acc)
            ok = self.send(self.acc, self.x if fetch else None)
        self.acc.zero_()
        self.acc_live = False
        self.snap.copy_(self.x)
        return ok


class AdagradRates:
    """``x <- x - gamma g / sqrt(G)`` with ``G`` the squared gradient sums of all workers, kept in the box."""

    def __init__(
        self,
        client: CenterClient,
        numel: int,
        gamma: float,
        device: torch.device,
        group: dict[str, Any] | None = None,
    ):
        self.client = client  # the squared-sums region of the box
        # gamma is read at each step from ``group`` (the local optimizer's param group, where the lr
        # schedule sets it), or fixed
        self.group = group if group is not None else {"lr": gamma}
        self.pulled = torch.zeros(numel, device=device)  # G as last pulled
        self.local = torch.zeros(numel, device=device)  # this worker's squares not yet pushed
        self.denom = torch.empty(numel, device=device)

    def step_(self, x: torch.Tensor, g: torch.Tensor) -> None:
        self.local.addcmul_(g, g)
        torch.add(self.pulled, self.local, out=self.denom).sqrt_().add_(ADAGRAD_EPS)
        x.addcdiv_(g, self.denom, value=-self.gamma)

    @property
    def gamma(self) -> float:
        return self.group["lr"]

    def fetch(self) -> None:
        self.client.pull(self.pulled)

    def push(self) -> bool:
        ok = self.client.push(self.local, count=False)  # rides along with the push of c
        self.pulled.add_(self.local)  # until the next fetch, our own squares count at once
        self.local.zero_()
        return ok


class Downpour(AsyncStrategy):
    """Downpour SGD. ``parambox train --strategy downpour --set downpour.n_push=4``"""

    name = "downpour"
    period_options = ("n_fetch", "n_push")
    shared_center = True
    # Every worker's update lands on the center: at the run's rate 0.03 it moves twice as far per step
    # (seed 3's default digits run ended at 0.9499); half the rate, as the studies' lr / N.
    default_optimizer = {"lr": 0.015}
    Options = DownpourOptions

    def __init__(self, ctx: Context, options: DownpourOptions, damped: bool = False):
        numel = sum(p.numel() for p in ctx.model.parameters())
        super().__init__(ctx, options, extra_numel=numel if getattr(options, "adagrad", False) else 0)
        self.optimizer = ctx.make_optimizer(self.params)
        n_fetch, n_push = self.exchange_periods()
        # Across nodes (a box with no local view) a push and the next step's fetch go as one
        # push-pull: the center flows back while the update flows out. Not with Adagrad's sums,
        # fetched with the center, nor on shm, where both are memory copies anyway.
        fuse = not getattr(options, "adagrad", False) and self.box.local_view() is None
        background = (
            Background(ctx.timeout_s, f"{self.name} exchange") if getattr(options, "overlap", False) else None
        )
        encoder = self._encoder(options)
        self.worker = DownpourWorker(self.client, self.x, n_fetch, n_push, damped, fuse, background, encoder)
        # Buckets push-pulled during backward: a fused exchange every step (a push, then the next
        # step's fetch), undamped (a damped push needs its staleness first), on the host, straight
        # to the cross-node box (a node's cache counts pushes: its rounds are whole updates).
        bucket = int(getattr(options, "bucket_mb", 0.0) * (1 << 20) / 4)
        self.finishing: FinishedTail | None = None
        if (
            bucket > 0
            and fuse
            and not damped
            and background is None
            and encoder is None  # a compressed push is encoded whole, after backward
            and n_fetch == n_push
            and self.num_workers > 1
            and self.x.device.type == "cpu"
            and not isinstance(self.box, NodeCachedBox)
        ):
            self.grad_views.close()
            self.grad_views = GradViews.of_flat(
                self.model, self.layout, self.g, track=True, on_ready=self._ready
            )
            offsets = [v.storage_offset() - self.g.storage_offset() for v in self.grad_views.views]
            self.finishing = FinishedTail([*offsets, self.numel], bucket)
        self.early_ok = False  # a push step whose loss was finite: its buckets may go during backward
        self.pushes_now = False
        self.sent_in_backward = 0
        self.parts: list[Handle] = []  # the buckets on their way
        self.refused = False  # a bucket's update was not finite
        self.adagrad = None
        if getattr(options, "adagrad", False):
            group = self.optimizer.param_groups[0]
            if self.world.rank == 0 and (
                type(self.optimizer) is not torch.optim.SGD or group.get("momentum")
            ):
                warn("downpour.adagrad replaces the local optimizer: --optimizer and --momentum are ignored")
            sums = CenterClient(self.box, self.numel, start=self.extra_start, timers=self.timers)
            self.adagrad = AdagradRates(sums, self.numel, group["lr"], self.x.device, group)
        self.warm = self.world.rank == 0 or getattr(options, "warmup_steps", 0) == 0

    def exchange_periods(self) -> tuple[int, int]:
        return self.options.n_fetch, self.options.n_push

    def _encoder(self, options: DownpourOptions) -> PushEncoder | None:
        """``downpour.compression``'s encoder of this worker's pushes (dynsgd's options have none)."""
        if getattr(options, "compression", "none") == "none":
            return None
        warns = self.world.rank == 0
        return box_encoder(self.name, options, self.box, self.numel, 0, self.x.device, warns)

    def begin_step(self, step: int) -> None:
        if not self.warm:
            self._await_warmup()
        self.worker.before_step(step)
        if self.adagrad is not None and step % self.worker.n_fetch == 0:
            self.adagrad.fetch()
        super().begin_step(step)
        if self.finishing is not None:
            self.finishing.reset()
            self.pushes_now = (step + 1) % self.worker.n_push == 0

    def before_backward(self, loss: torch.Tensor) -> None:
        self.early_ok = self.finishing is not None and self.pushes_now and not self.halted and is_finite(loss)

    def _ready(self, i: int, first: bool) -> None:
        """Parameter ``i`` has its gradient: once the finished tail holds a bucket, step the bucket's
        parameters and start its push-pull, while backward goes on."""
        bucket = self.finishing.finish(i) if self.early_ok else None
        if bucket is None:
            return
        params, lo, hi = bucket
        step_only(self.optimizer, self.grad_views.params, params)
        part = self.worker.exchange_part(lo, hi)
        if part is None:
            self.refused, self.early_ok = True, False
        else:
            self.parts.append(part)

    def _finish_early(self, loss: torch.Tensor | None, step: int) -> None:
        """A step whose buckets from ``finishing.cut`` on went during backward: the rest of the
        parameters stepped and push-pulled, the buckets' exchanges waited for with it."""
        parts, self.parts = self.parts, []
        self.sent_in_backward = len(parts)
        ok = not self.refused and self.guard(loss, step)
        if ok:
            step_only(self.optimizer, self.grad_views.params, range(self.finishing.cut_param))
            ok = self.worker.after_step(step, self.finishing.cut, parts)
        else:
            for part in parts:
                part.wait()
        self.refused = False
        if not ok:
            self.halt("update", step)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.early_ok = False
        if self.finishing is not None and self.finishing.cut < self.numel:
            self._finish_early(loss, step)
        elif self.guard(loss, step):
            if self.adagrad is not None:
                self.adagrad.step_(self.x, self.g)
            else:
                self.optimizer.step()
            if (step + 1) % self.worker.n_push == 0 and not self._push(step):
                self.halt("update", step)
        result = self.step_result(loss, samples)
        if self.finishing is not None:  # buckets push-pulled during backward
            result.extra["buckets_in_backward"], self.sent_in_backward = self.sent_in_backward, 0
        if self.worker.background is not None:
            result.extra["exchange_wait_s"], self.worker.waited = self.worker.waited, 0.0
        return result

    def _push(self, step: int | None = None) -> bool:
        if step is not None and self.adagrad is None:  # fused with the next fetch, or overlapped
            return self.worker.after_step(step)
        if not self.worker.push():
            return False
        return self.adagrad is None or self.adagrad.push()

    def _await_warmup(self) -> None:
        """The paper's warm start: wait until rank 0 has trained ``warmup_steps`` steps alone. No
        deadline on the whole warm-up (it may take longer than ``--timeout``): only on rank 0
        standing still, as for any lost worker."""
        m, k = self.counters, self.options.warmup_steps
        seen = {0: (-1, 0.0, 0)}

        def ready() -> bool:
            if self.box.read_counter(m.steps(0)) >= k or self.box.read_counter(m.status(0)):
                return True
            if self.membership.is_lost(0, seen):
                raise CommTimeout(f"downpour warm-up: rank 0 stopped before step {k} (it died or stalled)")
            return False

        with self.timers.phase("warmup"):
            wait_until(ready, float("inf"), lambda: "")
        self.warm = True

    def flush(self) -> None:
        self.worker.settle()
        # The last steps' update when the run does not end on a push.
        if self.worker.acc_live or not torch.equal(self.x, self.worker.snap):
            self._push()

    def close(self) -> None:
        try:
            self.worker.settle()  # the exchange in flight lands before the box goes
        finally:
            super().close()

    def state_dict(self) -> dict:
        self.worker.settle()  # the exchange in flight lands first: the state is one point
        state = super().state_dict()
        state["downpour"] = {
            "acc": self.worker.acc,
            "snap": self.worker.snap,
            "acc_live": self.worker.acc_live,
        }
        if self.worker.encoder is not None:
            state["downpour"]["error"] = self.worker.encoder.error  # what this worker's pushes still owe
        if self.adagrad is not None:  # this worker's squares not pushed yet (the box's sums: rank 0's)
            state["adagrad_local"] = self.adagrad.local
        return state

    def restart_from_center(self) -> None:
        worker = self.worker
        worker.snap.copy_(self.x)  # x is the center now: nothing of it is this worker's update
        worker.acc.zero_()
        worker.acc_live, worker.fetched_for = False, -1

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "downpour" in state:
            self.worker.acc.copy_(state["downpour"]["acc"])
            self.worker.snap.copy_(state["downpour"]["snap"])
            self.worker.acc_live = bool(state["downpour"]["acc_live"])
            if self.worker.encoder is not None and "error" in state["downpour"]:
                self.worker.encoder.error.copy_(state["downpour"]["error"])
        if self.adagrad is not None and "adagrad_local" in state:
            self.adagrad.local.copy_(state["adagrad_local"])
