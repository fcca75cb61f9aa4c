"""Sandblaster's coordinator machinery: farming one evaluation's portions out to workers.

Workers are the other ranks (gloo point-to-point) and, when the coordinator computes too, a thread
of its own with a replica of the model. Both answer into one queue, so the coordinator waits for
"any result" in one place; gloo's receives cannot be polled, so a thread receives from any rank
into that queue. The coordinator's main thread never computes: it hands out the next portion the
moment a worker is free.

Messages: up to ``FRAMES`` tasks to a worker (each ``TASK_FIELDS`` float64 ``[kind, evaluation,
portion, args...]``, then a payload: one flag per portion, or a vector operation's slots); back
``[evaluation, portion, loss sum, samples, seconds]``: scalars only.
The portion's gradient stays where it was computed (``PortionGrads``) until the coordinator says
which portions each worker won; then the winners' sum goes to the shard holders
(``strategy.py``), never to the coordinator. The weights of an evaluation reach the workers from
the shards the same way (an all-gather among the holders, who are the workers). A result of an
evaluation that is over, or of a portion a copy has already returned, is dropped: the first result
wins. Every worker computes on a thread of its own (``worker.py``) and stops a copy whose evaluation
is over; the stopped copy answers with 0 samples, which frees the worker and counts nowhere.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from parambox.errors import CommTimeout
from parambox.strategies.sandblaster.portions import PortionScheduler
from parambox.strategies.sandblaster.worker import EVAL_IDS, RESULT_FIELDS, PortionWorker

TASK, REPLY, RESULT = 11, 12, 13  # message tags
COMPUTE, END_STEP = 0.0, 1.0  # task kinds (the vector operations' kinds are in strategy.py)
TASK_FIELDS = 8  # kind, evaluation, portion or op, five arguments; then one flag per portion
FRAMES = 8  # tasks in one message at most
HEADER = 2  # evaluation, portion; loss sum, samples, seconds follow
RESULT_LEN = RESULT_FIELDS
BYE = -1.0  # a result's evaluation field when a worker leaves


def task_message_len(payload: int) -> int:
    """Floats in a task message: how many tasks it holds, then ``FRAMES`` tasks (zeros past those)."""
    return 1 + FRAMES * (TASK_FIELDS + payload)


@dataclass
class Evaluation:
    """Sums over one pass of the batch, which worker's result counted for each portion, how it went."""

    loss_sum: float
    samples: int
    winners: dict[int, int]  # portion -> the rank whose result was first (0: the coordinator's thread)
    seconds: float
    backups: int
    backup_wins: int


class PortionFarm:
    """Runs evaluations over ``remote`` ranks and an optional ``LocalWorker``; rank 0 only."""

    def __init__(
        self,
        remote: list[int],
        num_portions: int,
        timeout_s: float,
        backup: bool = True,
        group: dist.ProcessGroup | None = None,
        payload: int | None = None,
    ):
        self.payload = num_portions if payload is None else payload  # floats after a task's fields
        self.remote, self.num_portions, self.timeout_s, self.backup = remote, num_portions, timeout_s, backup
        self.group = group  # a gloo group (None: the default group, gloo on CPU)
        self.results: queue.Queue = queue.Queue()
        self.local: PortionWorker | None = None
        self.eval_id = 0
        self.busy: set[int] = set()  # workers computing a portion (maybe of an evaluation that is over)
        self.version: dict[int, int] = {}  # worker -> evaluation whose weights it holds
        # Sends per rank, numbered from 1 and kept alive until delivered. gloo's sends cannot be polled
        # either (a send's work says it is completed only once waited on), but an answer from a rank
        # proves it has received the message it answers and every one before: those are waited on
        # then, at no cost. Unreleased, they piled up over the run, and each result's look at them
        # slowed the coordinator to a crawl (a run of a few hundred steps seemed to hang).
        self.sends: dict[int, list[tuple[int, dist.Work, torch.Tensor]]] = {r: [] for r in remote}
        self.sent: dict[int, int] = {r: 0 for r in remote}  # messages sent per rank
        self.computing: dict[int, int] = {}  # rank -> the number of the message with its portion in hand
        self.queued: dict[int, list[torch.Tensor]] = {r: [] for r in remote}  # deferred tasks per rank
        self.portion_time: dict[int, list[float]] = {}  # rank -> [seconds, portions] after its first
        self.bytes_in = 0  # message bytes the coordinator received (results, operation replies), over the run
        self.stopped = 0  # copies stopped in flight, because their evaluation was over
        self.receiver: threading.Thread | None = None
        if remote:
            self.receiver = threading.Thread(target=self._receive, name="sandblaster-rx", daemon=True)
            self.receiver.start()

    def add_local(self, model: nn.Module, loss_fn: Callable, slow_factor: float = 1.0) -> None:
        self.local = PortionWorker(
            model, loss_fn, lambda out: self.results.put((0, out)), slow_factor,
            fail=lambda e: self.results.put((-1, e)),
        )  # fmt: skip

    @property
    def workers(self) -> list[int]:
        return ([0] if self.local is not None else []) + self.remote

    def _receive(self) -> None:
        """Results from any rank into the queue, until every rank has said bye."""
        left = len(self.remote)
        try:
            while left:
                buf = torch.empty(RESULT_LEN)
                src = dist.recv(buf, tag=RESULT, group=self.group)
                if buf[0] == BYE:
                    left -= 1
                else:
                    self.bytes_in += buf.numel() * buf.element_size()
                    self.results.put((src, buf))
        except Exception as e:  # the main thread turns this into a clear error
            self.results.put((-1, e))

    # -- one evaluation -------------------------------------------------------------------------
    def evaluate(self, weights: torch.Tensor, batch: tuple) -> Evaluation:
        """One pass over ``batch = (data, bounds)`` at ``weights`` (which must not change afterwards)."""
        t0 = time.perf_counter()
        self.eval_id = (self.eval_id + 1) % EVAL_IDS
        sched = PortionScheduler(len(batch[1]), backup=self.backup)
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        winners: dict[int, int] = {}
        free = [r for r in self.workers if r not in self.busy]
        while not sched.done:
            self._dispatch(sched, free, weights, batch)
            self._collect(sched, total, free, winners)
        if self.local is not None:  # remote workers stop theirs when told the winners
            self.local.cancel_through(self.eval_id)
        return Evaluation(
            float(total[0]),
            int(total[1]),
            winners,
            time.perf_counter() - t0,
            sched.backups,
            sched.backup_wins,
        )

    def _dispatch(
        self, sched: PortionScheduler, free: list[int], weights: torch.Tensor | None, batch: tuple
    ) -> None:
        """Portions to free workers; the remote ones hold this evaluation's weights already (the
        all-gather among the holders), the coordinator's thread gets them with its first task."""
        while free:
            portion = sched.next_for(free[0])
            if portion is None:
                return
            r = free.pop(0)
            fresh = self.version.get(r) != self.eval_id
            self.version[r] = self.eval_id
            self.busy.add(r)
            if r == 0:
                self.local.submit(self.eval_id, portion, weights if fresh else None, batch)
                continue
            self.send_task(r, [COMPUTE, self.eval_id, portion])
            self.computing[r] = self.sent[r]  # its result answers this message

    def _collect(
        self, sched: PortionScheduler, total: torch.Tensor, free: list[int], winners: dict[int, int]
    ) -> None:
        """Wait for one result, then take every other that has arrived."""
        block = True
        while True:
            try:
                src, buf = self.results.get(timeout=self.timeout_s) if block else self.results.get_nowait()
            except queue.Empty:
                if block:
                    raise CommTimeout(
                        f"sandblaster: no result from workers {sorted(self.busy)} in {self.timeout_s:.0f} s"
                    ) from None
                return
            if src < 0:
                raise CommTimeout(f"sandblaster: a worker's result was lost: {str(buf).splitlines()[0]}")
            block = False
            if src in self.computing:  # a worker computes one portion at a time: its result is this one's
                self._delivered(src, self.computing.pop(src))
            self.busy.discard(src)
            free.append(src)
            self._record(sched, total, winners, src, int(buf[0]), int(buf[1]), buf[HEADER:])

    def _record(self, sched, total, winners, rank: int, eval_id: int, portion: int, out: torch.Tensor):
        if out[1] == 0:  # a copy stopped because its evaluation was over: the worker is free, no more
            self.stopped += 1
            return
        seconds = self.portion_time.setdefault(rank, [0.0, -1])  # the first portion pays set-up costs
        if seconds[1] >= 0:
            seconds[0] += float(out[2])
        seconds[1] += 1
        if eval_id == self.eval_id and sched.complete(rank, portion):
            total += out[:2].double()
            winners[portion] = rank

    # -- messages -------------------------------------------------------------------------------
    def send_task(
        self, dst: int, fields: list[float], flags: list[float] | None = None, defer: bool = False
    ) -> None:
        """The task ``[fields... | flags or slots]`` to ``dst``. With ``defer`` it waits for the next
        task to ``dst`` that is not deferred, and goes in one message with it (a vector operation
        that needs no answer waits for the next that does: each message costs a wake-up on both sides)."""
        task = torch.zeros(TASK_FIELDS + self.payload, dtype=torch.float64)
        task[: len(fields)] = torch.tensor(fields, dtype=torch.float64)
        if flags is not None:
            task[TASK_FIELDS : TASK_FIELDS + len(flags)] = torch.tensor(flags, dtype=torch.float64)
        self.queued[dst].append(task)
        if not defer:
            self._flush(dst)

    def flush(self) -> None:
        """Send every deferred task now."""
        for r in self.remote:
            self._flush(r)

    def _flush(self, dst: int) -> None:
        queued = self.queued[dst]
        while queued:
            frames, queued[:] = queued[:FRAMES], queued[FRAMES:]
            msg = torch.zeros(task_message_len(self.payload), dtype=torch.float64)
            msg[0] = len(frames)
            msg[1 : 1 + len(frames) * (TASK_FIELDS + self.payload)] = torch.cat(frames)
            self._send(msg, dst, TASK)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.sent[dst] += 1
        self.sends[dst].append((self.sent[dst], dist.isend(tensor, dst, tag=tag, group=self.group), tensor))

    def delivered(self, r: int) -> None:
        """A reply from ``r`` came to the last message sent to it (the coordinator sends ``r`` nothing
        more until the reply is in): ``r`` has received everything sent to it."""
        self._delivered(r, self.sent[r])

    def _delivered(self, r: int, through: int) -> None:
        """``r`` has received the messages numbered up to ``through``: their sends are over, and go."""
        sends = self.sends[r]
        while sends and sends[0][0] <= through:
            _, work, _ = sends.pop(0)
            work.wait(timedelta(seconds=self.timeout_s))  # received already: returns at once

    def end_step(self, loss: float) -> None:
        """Tell every rank the step is over (a busy one reads it after its current portion)."""
        for r in self.remote:
            self.send_task(r, [END_STEP, 0.0, 0.0, loss])

    def mean_portion_seconds(self) -> dict[int, float]:
        return {r: s / n for r, (s, n) in sorted(self.portion_time.items()) if n > 0}

    def close(self) -> None:
        """After the last step, once every rank has sent its bye (collective with the workers)."""
        for r in self.remote:
            for _, work, _ in self.sends[r]:
                work.wait(timedelta(seconds=self.timeout_s))
            self.sends[r] = []
        if self.receiver is not None:
            self.receiver.join(self.timeout_s)
            if self.receiver.is_alive():
                raise CommTimeout(f"sandblaster shutdown: ranks {self.remote} never said bye")
            self.receiver = None
        if self.local is not None:
            self.local.cancel_through(self.eval_id)
            if not self.local.close(self.timeout_s):
                raise CommTimeout(
                    f"sandblaster shutdown: the coordinator's portion thread did not end in {self.timeout_s:.0f} s"
                )
            self.local = None
