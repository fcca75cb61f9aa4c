"""The periodic exchanges of weight-avg, diloco and synchronous easgd: compressed, and hidden behind compute.

:class:`ExchangeOptions` adds ``overlap`` and ``compression`` to a strategy's options
(:class:`CompressionOptions`: ``compression`` alone, for allreduce's gradients).

:class:`SumExchange` sums one flat float32 tensor over the ranks (plus an exact float32 tail for
counts and flags), encoded by a :class:`~parambox.strategies.compress.Compressor`. ``start`` begins
the collective with ``async_op=True`` and returns at once; ``wait`` blocks until it is done, and
the seconds it blocked are the step's ``exchange_wait_s``.

:class:`DeltaAverager` is the exchange of a round's progress ``delta = s - x`` (the replica at the
round's start minus now), averaged over the ranks and applied to the global weights ``theta`` by an
outer step (weight-avg: ``theta - mean delta``; diloco: Nesterov SGD on ``mean delta``). Undelayed,
a round ends with ``theta <- outer(theta, mean delta); x <- theta``. With ``overlap`` the rule is
parambox's own, *delayed global weights plus own progress*: the mean of a round's delta is applied one
round late, and each replica goes on from the global weights so updated (a round behind) plus its own
progress of the round just ended::

    delta_k = s - x;  theta <- outer(theta, mean delta_{k-1}) (waits);  start sum(delta_k)
    x <- theta - delta_k;  s <- x

It is neither Streaming DiLoCo's overlapped outer step (which mixes the arriving global fragment with the
local one, Douillard et al. 2025; ``diloco.fragment_sync_delay``, ``StreamingDiloco``) nor the eager one-step-delayed update of Kale et al. 2025 (which uses the
worker's own, undelayed pseudo-gradient in place of the missing mean): no mixing, and the own progress is
added to the delayed weights as it is.

With gradients that do not depend on the weights every round's delta is the same in both forms, so
both end at the same ``theta`` (tests/test_exchange.py checks the closed form).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import Field, field_validator

from parambox.box.base import ParameterBox
from parambox.errors import CommTimeout, warn
from parambox.strategies.base import Options
from parambox.strategies.compress import (
    DEFAULT_BLOCK,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_RATIO,
    Compression,
    Compressor,
    PushEncoder,
)
from parambox.strategies.powersgd import PowerSGD


class CompressionOptions(Options):
    """The encoding of a strategy's exchange: ``compression`` and its parameters."""

    compression: Compression = Field(
        "none",
        description="the exchange's encoding, with error feedback: none (float32), bf16, int8, int4 or int2 "
        "(per-block scales), sign (1 bit per element and a per-block scale), topk (the largest entries) or "
        "powersgd (a rank-r approximation of each weight matrix's gradient: allreduce and synchronous diloco)",
    )
    compression_block: int = Field(
        DEFAULT_BLOCK, ge=1, description="int8, int4, int2, sign: elements per scale"
    )
    compression_ratio: float = Field(
        DEFAULT_RATIO,
        gt=0,
        le=1,
        description="topk: the share of elements each message sends (0 < ratio <= 1)",
    )


class LowRankOptions(Options):
    """``powersgd_rank``, for the strategies that take ``compression=powersgd``."""

    powersgd_rank: int = Field(
        DEFAULT_POWERSGD_RANK,
        ge=1,
        description="compression=powersgd: the rank r of each weight matrix's approximation (P: rows x r, "
        "Q: columns x r)",
    )


class ExchangeOptions(CompressionOptions):
    # Whether the strategy's exchange takes compression=powersgd (diloco's synchronous outer gradients,
    # through :class:`LowRankExchange`); the others refuse it, naming the field.
    takes_powersgd: ClassVar[bool] = False

    overlap: bool = Field(
        False,
        description="exchange in the background; go on from the delayed global weights (the round's mean applied "
        "one round late) plus this worker's own progress",
    )

    @field_validator("compression")
    @classmethod
    def _gathered(cls, mode: str) -> str:
        if mode == "powersgd" and not cls.takes_powersgd:
            raise ValueError(
                "powersgd compresses allreduce's gradients and synchronous diloco's outer gradients (two "
                "allreduces per exchange), not this exchange"
            )
        return mode


def box_compressor(
    name: str, options: CompressionOptions, numel: int, device: torch.device, warns: bool = True
) -> Compressor | None:
    """The encoder of a push that the worker decodes itself (asynchronous diloco's pseudo-gradient where
    the box does not apply the outer step: the strategy runs it on float32), or None. The box stores
    float32, so the link carries float32 whatever the encoding: the pushed update is quantized (with
    error feedback), as a transport that carried the codes would deliver it, and the bytes stay (a
    warning says so, where ``warns``)."""
    if options.compression == "none":
        return None
    if warns:
        warn(
            f"{name}.compression={options.compression}: this box takes the worker's decoded float32 (the rma "
            "box's memory server, box.server, takes the codes): no link bytes are saved"
        )
    return Compressor(
        options.compression, numel, options.compression_block, device=device, ratio=options.compression_ratio
    )


def box_encoder(
    name: str,
    options: CompressionOptions,
    box: ParameterBox,
    numel: int,
    start: int = 0,
    device: torch.device | None = None,
    warns: bool = True,
) -> PushEncoder | None:
    """The encoder of a worker's pushes into ``box[start:start + numel]`` (``ParameterBox.push_encoded_async``:
    the codes cross the link to the rma box's memory server, which decodes them), or None without
    compression. Where the box cannot take codes the worker decodes and float32 moves: ``warns`` (one
    rank's) says so, naming ``name.compression``."""
    mode = options.compression
    if mode == "none":
        return None
    if warns and not box.decodes_pushes:
        warn(
            f"{name}.compression={mode}: the {box.backend} box here adds float32 that the worker decoded: no "
            "link bytes are saved (the rma box's memory server, box.server, takes the codes)"
        )
    pieces = box.code_pieces(start, numel)
    return PushEncoder(mode, pieces, start, options.compression_block, options.compression_ratio, device)


class SumExchange:
    """``sum_r x_r`` (and ``sum_r tail_r``) over the default group, compressed, in the background.

    >>> ex = SumExchange(numel=4, tail=1, world_size=2, compression="int8")  # doctest: +SKIP
    >>> ex.start(delta, torch.ones(1)); ...; total, count = ex.wait()  # doctest: +SKIP
    """

    def __init__(
        self,
        numel: int,
        tail: int,
        world_size: int,
        compression: Compression = "none",
        block: int = DEFAULT_BLOCK,
        device: torch.device | None = None,
        guard: Callable[[], AbstractContextManager[Any]] = nullcontext,
        ratio: float = DEFAULT_RATIO,
    ):
        self.numel, self.tail, self.world_size, self.guard = numel, tail, world_size, guard
        self.compressor = Compressor(compression, numel, block, device=device, ratio=ratio)
        self.bytes_sent = 0  # this rank's last message
        self.wait_s = 0.0  # seconds blocked in wait() since the last pop_wait()
        self._work: Any = None
        self._msg: torch.Tensor | None = None
        self._gathered: list[torch.Tensor] = []
        self._result: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kept: torch.Tensor | None = None
        # Kept from one exchange to the next: the uncompressed message, and the sums (a 100 MB tensor
        # allocated afresh each round is a fresh mapping, page faults and cleared pages: ~0.15 s a round
        # on one core for the 25M-parameter transformer, more than the rest of the round's arithmetic).
        self._buffer: torch.Tensor | None = None
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def pending(self) -> bool:
        """An exchange was started and its result not yet taken."""
        return self._msg is not None or self._result is not None

    def start(self, x: torch.Tensor, tail: torch.Tensor | None = None, keep: bool = False) -> None:
        """Encode and start summing ``x`` (and ``tail``); with ``keep`` the message is kept, so that
        :meth:`redo` can sum it again over a smaller group (an exchange in a run that survives in place)."""
        assert not self.pending, "one exchange at a time"
        msg = self._encode(x, tail)
        self._msg, self.bytes_sent = msg, msg.numel() * msg.element_size()
        self._kept = msg.clone() if keep else None
        self._launch()

    def _encode(self, x: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        """The compressor's message; uncompressed, ``x`` and ``tail`` copied into the kept buffer."""
        if self.compressor.mode != "none":
            return self.compressor.encode(x, tail)
        tail = torch.zeros(0, device=x.device) if tail is None else tail.reshape(-1).float()
        size = x.numel() + tail.numel()
        if self._buffer is None or self._buffer.numel() != size or self._buffer.device != x.device:
            self._buffer = torch.empty(size, device=x.device)
        self._buffer[: x.numel()].copy_(x.reshape(-1))
        self._buffer[x.numel() :].copy_(tail)
        return self._buffer

    def redo(self) -> None:
        """The kept message's exchange once more, over the process group as it is now (the survivors,
        after the one it started in failed); nothing is encoded again, so error feedback stays whole."""
        assert self._kept is not None, "redo() needs start(keep=True)"
        self._work, self._gathered, self._result = None, [], None
        self._msg = self._kept.clone()
        self._launch()

    def _launch(self) -> None:
        if self.world_size == 1:
            return
        msg = self._msg
        with self.guard():
            if self.compressor.mode == "none":
                self._work = dist.all_reduce(msg, async_op=True)
            else:  # the group's size now: fewer than world_size after survivors regrouped
                self._gathered = [torch.empty_like(msg) for _ in range(dist.get_world_size())]
                self._work = dist.all_gather(self._gathered, msg, async_op=True)

    def complete(self) -> None:
        """Block until the started exchange is done; its result is kept for :meth:`wait`."""
        if self._msg is None:
            return
        t0 = time.perf_counter()
        if self._work is not None:
            try:
                with self.guard():
                    self._work.wait()
            except BaseException:
                self._work = None  # a failed Work kept past its group's end can abort the process
                raise
        self.wait_s += time.perf_counter() - t0
        msgs = [self._msg] if self.world_size == 1 or self.compressor.mode == "none" else self._gathered
        tail, device = self.compressor.tail_numel(msgs[0]), msgs[0].device
        if self._sums is None or self._sums[1].numel() != tail or self._sums[0].device != device:
            self._sums = (torch.empty(self.numel, device=device), torch.empty(tail, device=device))
        total, tails = self._sums
        for i, m in enumerate(msgs):  # the ranks' messages in rank order, on every rank
            t = self.compressor.decode_into(m, total, add=i > 0)
            (tails.add_ if i else tails.copy_)(t)
        self._result = self._sums
        self._work, self._msg, self._gathered = None, None, []

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum x, sum tail)`` of the started exchange: buffers of this exchange, valid (and the
        caller's to change) until the next one completes."""
        self.complete()
        assert self._result is not None, "wait() without start()"
        result, self._result = self._result, None
        return result

    def restore(self, result: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """A completed exchange saved in a checkpoint (``peek``) becomes pending again."""
        self._result = None if result is None else (result[0].clone(), result[1].clone())

    def peek(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending exchange's result, completed now but still pending (for checkpoints)."""
        self.complete()
        return self._result

    def pop_wait(self) -> float:
        out, self.wait_s = self.wait_s, 0.0
        return out


class LowRankExchange(SumExchange):
    """:class:`SumExchange`'s interface over :class:`~parambox.strategies.powersgd.PowerSGD` (its
    ``compressor``): ``x`` laid out as ``shapes``; ``start`` runs both allreduces at once (no
    background), so ``wait`` only hands the result over.
    """

    def __init__(
        self,
        shapes: list[torch.Size],
        tail: int,
        world_size: int,
        rank: int,
        device: torch.device | None = None,
        guard: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ):
        super().__init__(sum(s.numel() for s in shapes), tail, world_size, "none", device=device, guard=guard)
        self.compressor = PowerSGD(shapes, rank, device)  # type: ignore[assignment]
        self._tail: torch.Tensor | None = None

    def start(self, x: torch.Tensor, tail: torch.Tensor | None = None, keep: bool = False) -> None:
        assert not self.pending, "one exchange at a time"
        self._tail = torch.zeros(0, device=x.device) if tail is None else tail.reshape(-1).float().clone()
        self._run(lambda reduce, n: self.compressor.reduce(x, self._tail, reduce, n, keep=keep))

    def redo(self) -> None:
        self._result = None
        self._run(lambda reduce, n: self.compressor.redo(self._tail, reduce, n))

    def _run(
        self, fn: Callable[[Callable[[torch.Tensor], None], int], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        t0 = time.perf_counter()
        if self.world_size == 1:
            self._result = fn(lambda t: None, 1)
        else:
            with self.guard():
                self._result = fn(lambda t: dist.all_reduce(t, async_op=True).wait(), dist.get_world_size())
        self.wait_s += time.perf_counter() - t0
        self.bytes_sent = self.compressor.bytes_sent

    def complete(self) -> None:
        """Nothing in flight: ``start`` ran the exchange."""


class DeltaAverager:
    """The mean over the ranks of a round's progress, applied to ``theta`` by ``outer_step(mean)``.

    ``theta`` is the flat global state (parameters, then float buffers); ``outer_step`` updates it in
    place from the mean delta. ``round_end_(x)`` returns the replica to continue from; ``flags``
    (one float per rank, summed) say who contributed: a rank whose delta is not finite sends zeros.
    """

    def __init__(
        self,
        theta: torch.Tensor,
        outer_step: Callable[[torch.Tensor], None],
        exchange: SumExchange,
        overlap: bool,
        rank: int,
    ):
        self.theta, self.outer_step, self.exchange, self.overlap, self.rank = (
            theta,
            outer_step,
            exchange,
            overlap,
            rank,
        )
        self.start_of_round = theta.clone()  # s
        self.delta = torch.empty_like(theta)  # kept, as the exchange's buffers are
        self.contributors = torch.ones(exchange.world_size)  # the last applied exchange's flags

    def flatten_(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The replica ``tensors`` as one flat tensor, in the averager's own buffer (no allocation):
        :meth:`round_end_`'s ``x``, until the round ends."""
        return torch.cat([t.detach().reshape(-1) for t in tensors], out=self.delta)

    def round_end_(self, x: torch.Tensor, contribute: bool = True, keep: bool = False) -> torch.Tensor:
        """End a round at replica ``x``; returns the replica the next round starts from (``s``: the
        caller reads it, and copies it into the model). ``keep`` (without overlap): if the exchange
        fails, :meth:`redo_` repeats it over the survivors."""
        delta = torch.sub(self.start_of_round, x, out=self.delta)
        flags = torch.zeros(self.exchange.world_size, device=x.device)
        if contribute:
            flags[self.rank] = 1.0
        else:
            delta.zero_()
            self.exchange.compressor.forget_error_()  # nor an old error: the flag says "nothing"
        if self.overlap:
            self._apply_pending()
            self.exchange.start(delta, flags)  # the message is a copy or an encoding: delta stays
            if contribute:
                torch.sub(self.theta, delta, out=self.start_of_round)
            else:
                self.start_of_round.copy_(self.theta)
            return self.start_of_round
        self.exchange.start(delta, flags, keep=keep)
        return self._round_over()

    def redo_(self) -> torch.Tensor:
        """The round's exchange again, over the group as it is now; as :meth:`round_end_`."""
        self.exchange.redo()
        return self._round_over()

    def _round_over(self) -> torch.Tensor:
        self._apply_pending()
        self.start_of_round.copy_(self.theta)
        return self.start_of_round

    def flush_(self) -> None:
        """Apply what is still pending (the end of the run)."""
        self._apply_pending()

    def _apply_pending(self) -> None:
        if not self.exchange.pending:
            return
        total, flags = self.exchange.wait()
        self.contributors = flags
        count = float(flags.sum())
        if count > 0:
            self.outer_step(total.div_(count))  # the exchange's buffer, ours until the next exchange

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"theta": self.theta.clone(), "start_of_round": self.start_of_round.clone()}
        if self.exchange.compressor.error is not None:
            state["error"] = self.exchange.compressor.error.clone()
        if isinstance(self.exchange, LowRankExchange):
            state["q"] = [q.clone() for q in self.exchange.compressor.qs]  # the run's, the same everywhere
        pending = self.exchange.peek()
        if pending is not None:
            state["pending"] = [pending[0].clone(), pending[1].clone()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, dst in (("theta", self.theta), ("start_of_round", self.start_of_round)):
            if key in state:
                dst.copy_(state[key])
        if "error" in state and self.exchange.compressor.error is not None:
            self.exchange.compressor.error.copy_(state["error"])
        if "q" in state and isinstance(self.exchange, LowRankExchange):
            self.exchange.compressor.load_state_dict({"q": state["q"]})
        if "pending" in state:
            self.exchange.restore((state["pending"][0], state["pending"][1]))


class Background:
    """One task at a time in a thread (an asynchronous round's push and pull), joined with a deadline.

    >>> bg = Background(timeout_s=5.0, what="diloco push")
    >>> bg.start(lambda: None); bg.wait() >= 0.0, bg.wait()
    (True, 0.0)
    """

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, task: Callable[[], None]) -> None:
        assert self._thread is None, "one task at a time"
        self._thread = threading.Thread(target=self._run, args=(task,), name=self.what, daemon=True)
        self._thread.start()

    def _run(self, task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as e:  # handed to the waiting thread
            self._error = e

    def wait(self) -> float:
        """Seconds blocked until the task ended (0 without one); its error, if any, is raised here."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise CommTimeout(f"{self.what} did not finish within {self.timeout_s:.0f} s")
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0
