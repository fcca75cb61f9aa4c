"""A Sandblaster worker's compute: a thread that computes portions, so that the rank stays free.

Every computing rank (a remote worker, and the coordinator when it computes) runs its portions on a
:class:`PortionWorker` thread. The rank's main thread meanwhile answers the coordinator's vector
operations and joins the holders' collectives, so an evaluation never waits for a slow worker's
portion in flight: once every portion has a result (a backup copy's, maybe), the evaluation is over,
the gradient all-reduce runs at once, and the copy still running is stopped (``cancel_through``), as
MapReduce and Hadoop stop the losing copy of a speculative task. A real machine stops at the next
check (before the forward pass, before the backward pass); the demo's slow machine, whose extra time
is a wait, stops at once. A stopped copy still answers (0 samples), which tells the coordinator the
worker is free.

>>> import queue, torch
>>> got = queue.Queue()
>>> w = PortionWorker(torch.nn.Linear(2, 1), lambda m, b: m(b).mean(), got.put)
>>> w.submit(1, 0, None, (torch.ones(4, 2), [(0, 4)]))
>>> got.get(timeout=10)[:2].tolist(), w.close()
([1.0, 0.0], True)
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from parambox.strategies.sandblaster.portions import compute_portion

EVAL_IDS = 2**24  # evaluation numbers travel as float32: exact below this
RESULT_FIELDS = 5  # evaluation, portion, loss sum, samples, seconds


class PortionGrads:
    """A worker's portion gradients, kept until the coordinator says which of them count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.grads: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, eval_id: int, portion: int, grad: torch.Tensor) -> None:
        with self.lock:
            self.grads[(eval_id, portion)] = grad

    def take_sum(self, eval_id: int, portions: list[int], numel: int) -> torch.Tensor:
        """The float64 sum of this evaluation's ``portions``; every gradient of it (and older) goes."""
        total = torch.zeros(numel, dtype=torch.float64)
        with self.lock:
            for p in portions:
                total += self.grads[(eval_id, p)].double()
            self.grads = {k: v for k, v in self.grads.items() if not is_over(k[0], eval_id)}
        return total


def is_over(eval_id: int, last_over: int) -> bool:
    """Whether evaluation ``eval_id`` is ``last_over`` or older (numbers wrap at ``EVAL_IDS``)."""
    return (last_over - eval_id) % EVAL_IDS < EVAL_IDS // 2


class PortionWorker:
    """Computes the portions it is given, one at a time, on a replica of the model, and hands each
    result (``[evaluation, portion, loss sum, samples, seconds]``) to ``deliver``; the gradient stays
    in ``grads``. ``deliver`` runs on this thread (a queue put, or a send to the coordinator)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        deliver: Callable[[torch.Tensor], None],
        slow_factor: float = 1.0,
        replicate: bool = True,
        fail: Callable[[BaseException], None] | None = None,
    ):
        # A replica where the caller's model may change while this computes (the coordinator's).
        self.model = copy.deepcopy(model) if replicate else model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_fn, self.deliver, self.slow_factor = loss_fn, deliver, slow_factor
        self.fail = fail  # told of an error on this thread, besides ``error``
        self.grads = PortionGrads()
        self.tasks: queue.Queue = queue.Queue()
        self.last_over = -1  # the newest evaluation known to be over: its portions are stopped
        self.error: BaseException | None = None
        self.computed, self.stopped, self.busy_s = 0, 0, 0.0  # over the run
        self.thread = threading.Thread(target=self._run, name="sandblaster-portions", daemon=True)
        self.thread.start()

    def submit(self, eval_id: int, portion: int, weights: torch.Tensor | None, batch: tuple) -> None:
        """Compute ``portion`` of ``batch = (data, bounds)`` at ``weights`` (None: the last ones)."""
        self.tasks.put((eval_id, portion, weights, batch))

    def cancel_through(self, eval_id: int) -> None:
        """Evaluation ``eval_id`` (and every older one) is over: stop its portions."""
        self.last_over = eval_id

    def _stale(self, eval_id: int) -> bool:
        return self.last_over >= 0 and is_over(eval_id, self.last_over)

    def _run(self) -> None:
        while (task := self.tasks.get()) is not None:
            eval_id, portion, weights, (batch, bounds) = task
            try:
                if weights is not None:
                    vector_to_parameters(weights.to(self.params[0].device), self.params)
                t0 = time.perf_counter()
                out = compute_portion(
                    self.model, self.loss_fn, batch, bounds[portion], self.slow_factor,
                    stopped=partial(self._stale, eval_id),
                )  # fmt: skip
                self.busy_s += time.perf_counter() - t0
                if out is None:  # stopped: 0 samples says "free again" and counts nowhere
                    self.stopped += 1
                    self.deliver(torch.tensor([float(eval_id), float(portion), 0.0, 0.0, 0.0]))
                    continue
                self.computed += 1
                self.grads.put(eval_id, portion, out[3:])
                self.deliver(torch.cat([torch.tensor([float(eval_id), float(portion)]), out[:3]]))
            except Exception as e:  # the rank's main thread raises it
                self.error = e
                if self.fail is not None:
                    self.fail(e)
                return

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop after the portion in hand (stopped too, if its evaluation is over); True if it ended."""
        self.tasks.put(None)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
