"""The center weights in the box, as every asynchronous worker sees them.

:class:`CounterMap` says where the box's int64 counters are (``version``, per-worker ``steps``,
``status`` and ``ident``, ``total``, ``reached``, then a strategy's own); the status bits ``DONE``,
``NONFINITE`` and ``FINAL`` live in ``status(r)``. :class:`CenterClient` is one worker's handle on
``c = box[start:start + numel]``: ``pull``, ``push`` (refusing non-finite updates, optionally damped
by staleness), ``push_pull`` (a push, then a pull, in one box request), ``push_encoded`` (an update encoded with error
feedback) and the fused elastic exchange of EASGD (``elastic_``; ``elastic_encoded_`` with compression).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from parambox.box import VERSION_COUNTER, ParameterBox
from parambox.box.base import Handle
from parambox.numerics import is_finite
from parambox.strategies.base import PhaseTimers
from parambox.strategies.compress import PushEncoder

# Status bits, each set once with add_counter: DONE, NONFINITE, FINAL by the worker itself, LOST by
# the memory rank that MPI told of the worker's death; BROKEN in status(0) by the leader, before FINAL,
# where a rank of the run died (the run's process group is broken: the ranks read the result from the box).
DONE, NONFINITE, FINAL, LOST, RESUMED, BROKEN = 1, 2, 4, 8, 16, 32


class CounterMap:
    """Indices of the box counters an asynchronous run uses (``world_size`` workers, ``extra`` more).

    ``total`` steps of all workers, ``reached`` (workers at their target), ``samples`` of all
    workers, ``ready`` (1 once rank 0 has put the initial center in the box, 2 once it has put a
    resumed one back), ``started`` (the run's start, microseconds since the epoch), ``lead`` (the
    workers that claimed rank 0's part at the end, rank 0 being lost: the first to claim leads).

    With ``spares`` (``box.spare_ranks``), after the strategy's own: ``proc(r)``, the MPI rank that
    now runs worker ``r``, plus one (0: rank ``r`` itself), and per spare ``assign(i)``, the worker it
    is to replace, plus one (0: none yet), and ``spare_ident(i)``, its process's identity.

    >>> m = CounterMap(2, extra=1)
    >>> m.version, m.steps(1), m.status(1), m.ident(1), m.total, m.reached, m.extra(0), m.num_counters
    (0, 2, 4, 6, 7, 8, 13, 14)
    >>> m = CounterMap(2, extra=1, spares=1)
    >>> m.proc(1), m.assign(0), m.spare_ident(0), m.num_counters
    (15, 16, 17, 18)
    """

    version = VERSION_COUNTER

    def __init__(self, world_size: int, extra: int = 0, spares: int = 0):
        self.world_size, self.num_extra, self.spares = world_size, extra, spares
        base = 1 + 3 * world_size
        self.total, self.reached, self.samples, self.ready, self.started, self.lead = range(base, base + 6)
        self._spare_base = 7 + 3 * world_size + extra
        self.num_counters = self._spare_base + (world_size + 2 * spares if spares else 0)

    def steps(self, r: int) -> int:
        return 1 + r  # the box's step_counter(r)

    def status(self, r: int) -> int:
        return 1 + self.world_size + r

    def ident(self, r: int) -> int:
        return 1 + 2 * self.world_size + r

    def extra(self, k: int) -> int:
        assert 0 <= k < self.num_extra
        return 7 + 3 * self.world_size + k

    def proc(self, r: int) -> int:
        assert self.spares and 0 <= r < self.world_size
        return self._spare_base + r

    def assign(self, i: int) -> int:
        assert 0 <= i < self.spares
        return self._spare_base + self.world_size + i

    def spare_ident(self, i: int) -> int:
        assert 0 <= i < self.spares
        return self._spare_base + self.world_size + self.spares + i


class CenterClient:
    """A worker's handle on the center weights ``c = box[start:start + numel]``.

    >>> client = CenterClient(box, numel=layout.numel)  # doctest: +SKIP
    >>> client.pull(x)                     # x <- c
    >>> client.push(a)                     # c <- c + a (refused, returning False, if a is not finite)
    >>> client.elastic_(x, alpha=0.1)      # d = alpha (x - c); x -= d; c += d, in three flat ops
    """

    def __init__(
        self, box: ParameterBox, numel: int, start: int = 0, timers: PhaseTimers | None = None, block: int = 0
    ):
        self.box, self.numel, self.start = box, numel, start
        self.timers = timers if timers is not None else PhaseTimers()
        # 0: the elastic exchange works on the whole buffer at once (fewest operations: fastest here).
        self.block = block
        self.pulled_version = 0
        self.staleness = 0
        self._c = self._d = None

    def pull(self, out: torch.Tensor) -> torch.Tensor:
        """``out <- c``; remembers the version for staleness."""
        with self.timers.phase("pull"):
            version = self.box.add_counter_async(VERSION_COUNTER, 0)  # read while the pull travels
            self.box.pull(out, self.start)
            self.pulled_version = version.wait()
        return out

    def push(self, delta: torch.Tensor, scale: float = 1.0, damped: bool = False, count: bool = True) -> bool:
        """``c <- c + scale * delta`` (times ``1/(s + 1)`` if ``damped``); False, pushing nothing, if not finite.

        ``count=False``: a region that rides along with a counted push (Downpour's Adagrad sums)
        bumps no version, so staleness keeps counting whole pushes."""
        if not is_finite(delta):
            return False
        with self.timers.phase("push"):
            if count:
                self.staleness = self.box.add_counter(VERSION_COUNTER, 1) - self.pulled_version
            if damped:
                scale /= self.staleness + 1
            self.box.push(delta, scale, self.start)
        return True

    def push_pull(
        self,
        delta: torch.Tensor,
        out: torch.Tensor,
        scale: float = 1.0,
        damped: bool = False,
        parts: Sequence[Handle] = (),
    ) -> bool:
        """``c <- c + scale * delta``, then ``out <- c`` (with this push in), as one box request
        (``ParameterBox.push_pull``: on the memory server the pull flows back while the push flows out);
        False, moving nothing, if ``delta`` is not finite. ``delta`` and ``out`` start at ``c``'s
        start; ``parts``: the push-pulls of the rest of ``c`` already on their way (Downpour's
        buckets sent during backward), waited for here and counted with this one as one version."""
        if not is_finite(delta):
            for h in parts:
                h.wait()
            return False
        with self._exchange(known=damped):
            if damped:
                scale /= self.staleness + 1
            if delta.numel():
                self.box.push_pull(delta, out, scale, self.start)
            for h in parts:
                h.wait()
        return True

    def push_encoded(
        self,
        encoder: PushEncoder,
        delta: torch.Tensor,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
        messages: Sequence[torch.Tensor] | None = None,
    ) -> bool:
        """``c <- c + scale * decode(encode(delta))`` with ``encoder``'s error feedback (kept in units of
        ``delta``; ``box.push_encoded_async``: on the memory server the codes cross the link); with ``out``,
        then ``out <- c`` in the same request, as ``push_pull``. False, encoding and moving nothing, if
        ``delta`` is not finite. ``messages``: ``delta`` encoded already (by ``encoder``)."""
        if not is_finite(delta):
            return False
        if messages is None:
            messages = encoder.encode(delta)
        if out is None:
            with self.timers.phase("push"):
                self.staleness = self.box.add_counter(VERSION_COUNTER, 1) - self.pulled_version
                self.box.push_encoded_async(
                    messages, delta.numel(), encoder.code, encoder.params, scale, self.start
                ).wait()
            return True
        with self._exchange():
            self.box.push_encoded_async(
                messages, delta.numel(), encoder.code, encoder.params, scale, self.start, out
            ).wait()
        return True

    def outer_step(
        self,
        g: torch.Tensor,
        out: torch.Tensor,
        coefficients: tuple,
        last: bool,
        encoder: PushEncoder | None = None,
        messages: Sequence[torch.Tensor] | None = None,
    ) -> bool:
        """Asynchronous DiLoCo's outer step applied by the box itself (``fuses_outer_step``), the new
        theta brought back into ``out``, as a ``push_pull`` is; False, moving nothing, if ``g`` is not
        finite. ``messages``: ``g`` as ``encoder`` encoded it, sent in its place (the memory server decodes
        them, then applies the step: ``box.outer_step_encoded_async``)."""
        if not is_finite(g):
            return False
        with self._exchange():
            if messages is None:
                self.box.outer_step_async(g, out, coefficients, last, self.start).wait()
            else:
                self.box.outer_step_encoded_async(
                    messages, g.numel(), encoder.code, encoder.params, out, coefficients, last, self.start
                ).wait()
        return True

    @contextlib.contextmanager
    def _exchange(self, known: bool = False) -> Iterator[None]:
        """A push that brings the center back: counted as one version, after which this worker holds
        the version it made. The count travels with the exchange; ``known``: it is waited for first,
        so that ``staleness`` is set inside the block (a damped push scales by it)."""
        with self.timers.phase("push_pull"):
            count = self.box.add_counter_async(VERSION_COUNTER, 1)
            if known:
                self.staleness = count.wait() - self.pulled_version
            yield
            version = count.wait()
            self.staleness = version - self.pulled_version
            self.pulled_version = version + 1

    def elastic_(self, x: torch.Tensor, alpha: float) -> bool:
        """Asynchronous EASGD exchange: ``d = alpha (x - c); x <- x - d; c <- c + d``.

        Three flat operations: ``e = x - c`` (on the ``shm`` box read straight from shared memory,
        no pull copy), ``x -= alpha e``, and the push ``c += alpha e``: on 1M parameters here
        0.8-1.4 ms (warm/cold caches) against 1.5-1.9 ms for pull, subtract, scale, update, push. On
        the rma box's memory server (``fuses_elastic``) ``e`` and the push are one request
        (``ParameterBox.elastic_async``): ``x`` goes out, ``e`` comes back, ``c`` moves on the server. With
        ``block`` it walks the buffer in pieces of that many elements. A non-finite ``e`` stops it
        before its piece is pushed (nothing non-finite reaches the box) and returns False; with
        ``block`` a non-finite ``x`` is refused before the first piece, so an exchange is pushed
        whole or not at all (``c`` is finite by construction, so ``x - c`` is finite where ``x`` is).
        """
        n = self.numel
        block = min(self.block or n, n)
        if block < n and not is_finite(x):
            return False
        shared = self._shared(x)
        fused = shared is None and self.box.fuses_elastic  # the memory server moves c with what it is sent
        if self._d is None or self._d.numel() != block or self._d.device != x.device:
            self._d = torch.empty(block, device=x.device)
            self._c = None if shared is not None or fused else torch.empty(block, device=x.device)
        pulled = self.box.add_counter_async(VERSION_COUNTER, 0)  # read while the pull travels
        if fused and block == n and not is_finite(x):
            pulled.wait()
            return False
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            e = self._d[: hi - lo]
            if fused:  # one request: x out, e = x - c back, c += alpha e on the server
                with self.timers.phase("push_pull"):
                    self.box.elastic_async(x[lo:hi], e, alpha, self.start + lo).wait()
                x[lo:hi].sub_(e, alpha=alpha)
                continue
            with self.timers.phase("pull"):  # on shm the read of c is the subtraction itself
                c = (
                    shared[lo:hi]
                    if shared is not None
                    else self.box.pull(self._c[: hi - lo], self.start + lo)
                )
                torch.sub(x[lo:hi], c, out=e)
            if not is_finite(e):
                pulled.wait()  # nothing left in flight
                return False
            x[lo:hi].sub_(e, alpha=alpha)
            with self.timers.phase("push"):
                self.box.push(e, alpha, self.start + lo)
        with self.timers.phase("push_pull" if fused else "push"):
            version = self.box.add_counter(VERSION_COUNTER, 1)
            self.pulled_version = pulled.wait()
            self.staleness = version - self.pulled_version
        return True

    def elastic_encoded_(self, x: torch.Tensor, alpha: float, encoder: PushEncoder, e: torch.Tensor) -> bool:
        """Asynchronous EASGD exchange with an encoded push: ``e = x - c; x <- x - alpha e;
        c <- c + alpha D(Q(e + err))``, ``encoder``'s error ``err`` keeping what the message left out
        (``push_encoded``: the rma memory server decodes the codes). ``e``: a buffer of ``x``'s size.
        False, moving nothing and the error untouched, if ``e`` is not finite."""
        torch.sub(x, self.pull(e), out=e)
        if not is_finite(e):
            return False
        x.sub_(e, alpha=alpha)
        return self.push_encoded(encoder, e, scale=alpha)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The center itself, mapped in this process (a box with a local view, host replica), else None."""
        view = self.box.local_view()
        if view is None or x.device.type != "cpu":
            return None
        return view[self.start : self.start + self.numel]
