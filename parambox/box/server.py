"""The ``rma`` box with a memory server: the box ranks apply pushes themselves (``box.server``).

Why: Open MPI's one-sided component over TCP (osc/rdma on btl/tcp) has no network atomics, so each
``Accumulate`` is a locked get-modify-put: 3.14x the bytes of the buffer cross the link (measured in
issue 17). The Soft Memory Box's memory node applies accumulates itself; so does this box. Every box
rank runs a serving thread that receives requests over two-sided messages (``Isend``/``Irecv`` of
float32 chunks on a communicator of its own) and applies ``buf += scale * delta`` in place: a pushed
byte and a pulled byte cross the link once. Where the shards live is decided as for the window box
(``memory_ranks``, ``num_shards``, ``box_ranks``).

Protocol. A request is an int64 header ``[op, tag, start, n, counter, value, p0..p3]`` (``value``: the
scale's float64 bits for a push; ``p0..p3``: an outer step's coefficients) sent with ``REQUEST_TAG``
to the shard's rank; its payload (push, write)
follows as chunks of ``CHUNK`` elements on the request's own ``tag``, and the reply (an int64 ack or
the counter's old value; for a pull, the chunks) comes back on its twin tag, into receives posted before
the header went out. Tags count up per client, so two outstanding requests never match each other's
messages. A push-pull is a push whose server sends each chunk of the shard back as soon as it has
applied it (no ack): the pull's bytes flow back while the push's still flow out. A once-only push-pull
(``push_pull_once``, the node cache's sync) names its origin (``counter``) and a sequence number (``p0``): its
server applies a chunk once per pair, so a resend of a sync cut by a death adds only what had not landed. The server applies each chunk of a push as it lands, under a lock that its own rank's local
operations take too (atomic per element against other pushers, as the contract asks); a push's
handle completes when the server has applied it (its ack), like a ``Flush``.

An elastic exchange (``elastic_async``, EASGD's, ``ELASTIC``): the worker's replica ``x`` goes out as a
push does, and per chunk, under the shard's lock, the server turns it into ``e = x - c`` in place, moves
``c += alpha e`` and sends ``e`` back at once: one request, both directions of the link at once (a pull
and then a push ran each at about 70 % of a 0.1 Gbit/s link's rate), and no push lands between a
chunk's read and its update.

Gated pulls (``pull_when_async``, for the synchronous mean of ``box/levels.py``): a push may name a
*key* (``counter`` field, key + 1), and its server counts the elements applied under that key; a
``PULL_WHEN`` of a key waits on the server, parked, until the count reaches the request's target,
then answers as a pull. The workers of a synchronous step push a block each and ask at once for the
block's sum once all n have landed: no barrier, and each block flows back as soon as it is whole
(pipelined, as a ring allreduce's buckets), while later blocks still flow out.

Encoded pushes (``push_encoded_async``: ``PUSH_CODED``, ``PUSH_PULL_CODED``): a worker's update
encoded with error feedback (``strategies/compress.py``), one message per shard (``code_pieces``); the
header names the encoding (``counter``: its code; floats: scale, the message's bytes, the encoding's
two parameters) and the payload is the message's bytes, in chunks of ``4 * CHUNK``. The server decodes
it with the decoder the encodings' module set (``box.base.set_decoder``: the box knows no encoding)
once all its bytes have landed, adds the float32 values under the shard's lock, and answers with an
ack or, for a push-pull, the shard's chunks: the codes cross the link, float32 comes back.
``payload_bytes`` counts what a client sent to other ranks (pushes, writes, encoded pushes).

Faults: every wait has a deadline. The server never blocks: it polls its receives (``Test``, napping
with a back-off when nothing moves, so it costs a training rank little CPU); a request whose peer dies
(``ERR_PROC_FAILED`` under ``mpiexec --with-ft ulfm``) or stalls past the box's timeout is dropped,
and the serving goes on for the others. ``close`` stops the thread after the closing barrier.

The outer step of asynchronous DiLoCo (``outer_step_async``: Delayed Nesterov, Liu et al. 2024, Alg. 3)
runs here too. Each element of a shard has a *companion* pair (momentum ``m``, block accumulator ``a``)
kept beside it by its server (allocated on first use); an ``OUTER`` request carries the arrival's
pseudo-gradient ``g`` and the rule's coefficients, and the server applies, element by element::

    a += g / N;  if last:  m <- beta m + a;  a <- 0;  theta -= lr (k_last m + g / N)
                 else:                               theta -= lr (k m + g / N)

computed aside per chunk as it lands (theta's chunk sent back at once, as a push-pull does: the arrival's
bytes cross the link once each way) and committed, theta, ``m`` and ``a`` together, when its last chunk
has landed: an arrival whose sender dies half way is applied to no element of the shard. (A box sharded
over several memory ranks commits per shard: a death while the arrival's sends go out can leave it in
some shards and not in others.) Done by the worker, the same step moved 4.5x the model per arrival with 2 workers (the
block's accumulator and momentum pulled and written back). The companions are read and written for
checkpoints (``pull_companion``, ``write_companion``). Arrivals stay in ticket order (the strategy's
ticket lock), so the result is Alg. 3's.

With a quorum (Decoupled DiLoCo: the request's ``counter`` has ``QUORUM`` set beside ``last``; the
coefficients ``(lr, beta, share)``), ``a`` is the weighted mean of the pending arrivals and theta moves
only at the arrival that closes the step (which the client decides under its turn)::

    a <- a + share (g - a);  if last:  m <- beta m + a;  theta -= lr (a + beta m);  a <- 0

staged and committed whole in the same way; an arrival that closes nothing gets theta back unchanged.

An encoded arrival (``outer_step_encoded_async``: ``OUTER_CODED``, ``diloco.compression`` on this box): the
pseudo-gradient encoded with the worker's error feedback, one message a shard as an encoded push; the
header's ``counter`` holds the rule's flags and, above them, the encoding's code, its floats the five
coefficients, then the message's bytes and the encoding's two parameters. Once all its bytes have landed
the server decodes it and applies the same outer step to the decoded values, the whole shard at once
under the lock (so also whole or not at all), and sends theta back: the codes cross the link, float32
comes back.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from parambox.box.base import (
    FIRST_NAP_S,
    Count,
    Handle,
    ParameterBox,
    _host_flat,
    _is_host_flat,
    _StagedPull,
    decode_push,
    grown_nap,
    wait_until,
)
from parambox.box.layout import shard_range
from parambox.box.rma import MPI, pbmpi, wait_request
from parambox.errors import BoxLost, CommTimeout

REQUEST_TAG = 1
_FIRST_TAG = 16
# 256 KiB messages: the server adds one while the next is on the wire, and each goes out eagerly over
# Open MPI's TCP transport (``runtime.spawn.TCP_EAGER_ENV``), so ranks that serve each other send at once.
# A push-pull's answer starts after the first message has landed: of 2 MiB each way at 0.1 Gbit/s,
# 1 MiB messages took 277 ms, 256 KiB ones 183 ms (the link alone: 175); downpour's step 335 -> 260 ms.
CHUNK = 1 << 16
PUSH, PULL, WRITE, COUNTER, PUSH_PULL = 1, 2, 3, 4, 5
OUTER, COMPANION_PULL, COMPANION_WRITE = 6, 7, 8  # asynchronous DiLoCo's outer step, and its state
QUORUM = 2  # an OUTER request's flag (``counter`` field, beside bit 0, ``last``): the quorum rule
PULL_WHEN = 9  # a pull parked until the pushes of a key have landed (see the module's docstring)
PUSH_CODED, PUSH_PULL_CODED = 10, 11  # an encoded push (and pull): the server decodes it (module docstring)
OUTER_CODED = 12  # an outer step whose pseudo-gradient is encoded: decoded first, then the step (docstring)
ELASTIC = 13  # EASGD's exchange: x in, x - c back, c += alpha (x - c) (the module's docstring)
_CODED = (PUSH_CODED, PUSH_PULL_CODED, OUTER_CODED)
_OUTER_FLAGS = 3  # an OUTER_CODED request's ``counter``: the outer step's flags, then the encoding's code
_HEADER = 13  # [op, tag, start, n, counter, then 8 float64 fields]
_NAP_S = 5e-4  # the longest nap while requests are under way and moving
# Past that, nothing having moved for a while (a slow link: a 256 KiB chunk lands every 21 ms at
# 0.1 Gbit/s), a nap is _QUIET_SHARE of the time since anything last moved, up to _QUIET_NAP_S (as a
# client's long wait naps, box/base.py): a landing is seen at most that share late, and the kernel's
# socket buffers keep the link busy meanwhile. A look (a wake-up, a Testsome, a sleep) is CPU taken
# from the training on the same cores: this thread used 0.8-1.3 s of it a step of gpt-25m there.
_QUIET_SHARE, _QUIET_NAP_S = 1 / 2, 4e-3
_IDLE_NAP_S = 2e-3  # the longest nap of an idle server: a request waits at most this to be seen
# How often the server looks at deadlines, and at parked pulls when no push has landed since the last
# look: a look at every nap cost O(requests) per nap, with about a hundred under way through a step of
# the 25M-parameter model at 0.1 Gbit/s (a bucket each way), and that came out of the training.
_SWEEP_S = 0.1


def next_nap(nap: float, moved: bool, serving: bool, quiet_s: float) -> float:
    """The server's next nap after one of ``nap``: the first again once anything ``moved``; else twice
    the last, up to ``_NAP_S`` while ``serving`` requests (``_IDLE_NAP_S`` idle), and past that, requests
    under way but nothing moved for ``quiet_s``, ``_QUIET_SHARE`` of it, up to ``_QUIET_NAP_S``.

    >>> next_nap(4e-4, True, True, 0.0) == FIRST_NAP_S, next_nap(3e-3, False, True, 0.04)
    (True, 0.004)
    """
    if moved:
        return FIRST_NAP_S
    if not serving:
        return min(2 * nap, _IDLE_NAP_S)
    return grown_nap(nap, quiet_s, _NAP_S, _QUIET_SHARE, _QUIET_NAP_S)


_FAILED = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


def request_header(
    op: int, start: int, n: int, counter: int = 0, scale: float = 1.0, *more: float
) -> np.ndarray:
    """A request's header (the module's docstring), its tag still 0."""
    header = np.zeros(_HEADER, dtype=np.int64)
    header[:5] = [op, 0, start, n, counter]
    header[5:].view(np.float64)[: 1 + len(more)] = [scale, *more]
    return header


def _coded_fields(header: np.ndarray) -> tuple[int, int, tuple[float, float]]:
    """An encoded request's (code, message bytes, the encoding's two parameters): after the scale (a push)
    or the outer step's five coefficients (``OUTER_CODED``, whose code rides above its flags)."""
    floats, counter = header[5:].view(np.float64), int(header[4])
    if int(header[0]) == OUTER_CODED:
        return counter >> 2, int(floats[5]), (float(floats[6]), float(floats[7]))
    return counter, int(floats[1]), (float(floats[2]), float(floats[3]))


def _failure_class(e: MPI.Exception) -> str | None:
    """The ULFM error class name of ``e`` if it says a peer failed, else None."""
    cls = e.Get_error_class()
    for name in _FAILED:
        if getattr(MPI, name, None) == cls:
            return name
    return None


def _payload(tag: int) -> int:
    """The tag of a request's payload, client to server; its reply goes the other way on another one:
    a rank that serves and also asks must never match its peer's payload with a reply it awaits."""
    return 2 * tag


def _reply(tag: int) -> int:
    return 2 * tag + 1


def _chunks(lo: int, hi: int, size: int = CHUNK):
    for a in range(lo, hi, size):
        yield a, min(hi, a + size)


def _cancel(reqs: list) -> None:
    """Cancel receives and complete them: a receive left pending holds MPI_Finalize up for ~30 s."""
    for r in reqs:
        try:
            r.Cancel()
            r.Wait()
        except MPI.Exception:
            pass


class _Requests(Handle):
    """Requests of one transfer to ``box``'s ranks; ``wait`` until all complete (``CommTimeout`` after the
    deadline, ``BoxLost`` naming the rank where one that holds part of the box died)."""

    def __init__(self, reqs: list, keep: list, box: ServerBox, what: str):
        self.reqs, self.keep, self.box, self.what = reqs, keep, box, what

    def wait(self) -> None:
        if self.reqs:
            msg = f"{self.what}: no answer within {self.box.timeout:.0f} s"
            with self.box.peer_failures(self.what):
                wait_until(lambda: MPI.Request.Testall(self.reqs), self.box.timeout, lambda: msg)
        self.reqs, self.keep = [], []

    def test(self) -> bool:
        with self.box.peer_failures(self.what):
            if self.reqs and not MPI.Request.Testall(self.reqs):
                return False
        self.reqs, self.keep = [], []
        return True


class _RemoteCount(Count):
    """A counter request to the counters' rank: the old value arrives in the reply."""

    def __init__(self, box: ServerBox, header: np.ndarray, i: int):
        super().__init__()
        self.old = np.zeros(1, dtype=np.int64)
        tag = int(header[1])
        reqs = [
            box.data.Irecv(self.old, box.counter_rank, _reply(tag)),
            box.data.Isend(header, box.counter_rank, REQUEST_TAG),
        ]
        self.requests: _Requests | None = _Requests(reqs, [header], box, f"box {box.name!r} counter {i}")

    def wait(self) -> int:
        if self.requests is not None:
            self.requests.wait()
            self.requests, self.value = None, int(self.old[0])
        return self.value

    def test(self) -> bool:
        if self.requests is not None and not self.requests.test():
            return False
        self.wait()
        return True


class _LocalGated(Handle):
    """A gated pull from this rank's own shard: ``wait`` until the pushes have landed, then copy."""

    def __init__(self, box: ServerBox, out: np.ndarray, at: int, key: int, target: int):
        self.box, self.out, self.at, self.key, self.target = box, out, at, key, target

    def wait(self) -> None:
        if self.out is None:
            return
        box = self.box
        wait_until(
            lambda: box.landed(self.key, self.target),
            box.timeout,
            lambda: f"box {box.name!r} gated pull: the pushes did not all land within {box.timeout:.0f} s",
        )
        self._copy()

    def test(self) -> bool:
        if self.out is not None and not self.box.landed(self.key, self.target):
            return False
        self._copy()
        return True

    def _copy(self) -> None:
        if self.out is not None:
            np.copyto(self.out, self.box.shard[self.at : self.at + len(self.out)])
            self.out = None


class _Job:
    """A request the server is working on: chunks to receive and apply, or sends to complete."""

    def __init__(self, src: int, header: np.ndarray, deadline: float):
        self.src, self.header, self.deadline = src, header, deadline
        self.recvs: list[tuple[MPI.Request, int, int]] = []  # (request, lo, hi) in the shard
        self.sends: list[MPI.Request] = []
        self.keep: list = []
        self.staged: list[tuple[int, int, np.ndarray]] = []  # an outer step's (lo, hi, [theta, m, a]) so far
        self.next = 0


class _Server(threading.Thread):
    """The serving loop of one box rank (a daemon thread; ``stop()`` ends it)."""

    def __init__(self, box: ServerBox):
        super().__init__(name=f"parambox-box-{box.name}", daemon=True)
        self.box, self.comm = box, box.data
        self._halt = threading.Event()
        self.jobs: list[_Job] = []
        self.parked: list[_Job] = []  # PULL_WHEN requests whose pushes have not all landed
        self.dropped = 0
        self._seen_arrivals = -1  # the box's count of keyed pushes when the parked pulls were last looked at
        self._sweep_at = 0.0  # when the deadlines are next looked at

    def stop(self, timeout: float = 10.0) -> None:
        self._halt.set()
        self.join(timeout)

    def run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # the clients time out naming the box; say why here
            warnings.warn(f"box {self.box.name!r}: its server stopped: {type(e).__name__}: {e}", stacklevel=1)

    def _serve(self) -> None:
        header = np.empty(_HEADER, dtype=np.int64)
        status = MPI.Status()
        req = self.comm.Irecv(header, MPI.ANY_SOURCE, REQUEST_TAG)
        nap, moved_at = FIRST_NAP_S, time.monotonic()
        while not self._halt.is_set():
            busy = False
            try:
                got = req.Test(status)
            except MPI.Exception as e:
                if _failure_class(e) is None:
                    raise
                self.comm.Ack_failed()  # a peer died: the any-source receive goes on for the others
                header, req = self._repost(req, header, status)
                got = False
            if got:
                self._start(status.Get_source(), header.copy())
                req = self.comm.Irecv(header, MPI.ANY_SOURCE, REQUEST_TAG)
                busy = True
            now = time.monotonic()
            sweep = now >= self._sweep_at
            if sweep:
                self._sweep_at = now + _SWEEP_S
            busy = self._unpark(sweep) or self._progress(sweep) or busy
            # Nap, each twice the last, from the first again after anything moved: this thread shares a core
            # with training, so no spin (a spin slowed the box's rules, bench cluster), and a sleep costs CPU too.
            if busy:
                moved_at = now
            nap = next_nap(nap, busy, bool(self.jobs or self.parked), now - moved_at)
            time.sleep(nap)
        _cancel([req])
        for job in self.jobs:
            _cancel([r for r, _, _ in job.recvs[job.next :]])

    def _repost(
        self, req: MPI.Request, header: np.ndarray, status: MPI.Status
    ) -> tuple[np.ndarray, MPI.Request]:
        """A fresh any-source receive of requests after a peer's failure interrupted ``req``.

        ULFM leaves a receive that raised ``ERR_PROC_FAILED_PENDING`` pending, to be tested again
        once the failure is acknowledged; but where a second failure notice raced the
        acknowledgement, Open MPI 5 raised it again and the receive then never matched (1 run in 3
        of the ULFM test hung with a client's request unseen). So it is cancelled (or, if a request
        landed in it meanwhile, that request is started) and a new one posted into a new buffer."""
        try:
            req.Cancel()
            req.Wait(status)
            if not status.Is_cancelled():
                self._start(status.Get_source(), header.copy())
        except MPI.Exception:
            pass  # completed in error: nothing landed in it
        header = np.empty(_HEADER, dtype=np.int64)
        return header, self.comm.Irecv(header, MPI.ANY_SOURCE, REQUEST_TAG)

    def _start(self, src: int, h: np.ndarray) -> None:
        op, tag, start, n = (int(v) for v in h[:4])
        box = self.box
        job = _Job(src, h, time.monotonic() + box.timeout)
        if op == COUNTER:
            with box.lock:
                old = box.counters[h[4]].copy()
                box.counters[h[4]] += h[5]
            job.keep = [old.reshape(1)]
            job.sends.append(self.comm.Isend(job.keep[0], src, _reply(tag)))
        elif op == PULL_WHEN and not box.landed(int(h[4]), int(h[5])):
            self.parked.append(job)
            return
        elif op in (PULL, COMPANION_PULL, PULL_WHEN):
            # Straight from the shard, no copy first (it cost a 32 MB pull 0.82 instead of 0.88 of a
            # 1 Gbit/s link): a pull takes no lock and may see a push half applied, as the box's contract
            # allows; aligned float32 words are never torn.
            whole = box.companion()[int(h[4])] if op == COMPANION_PULL else box.shard
            view = whole[start - box.my_start :][:n]
            job.sends = [self.comm.Isend(view[a:b], src, _reply(tag)) for a, b in _chunks(0, n)]
        elif op in _CODED:  # the message's bytes, decoded and applied once all have landed
            stage = np.empty(_coded_fields(h)[1], dtype=np.uint8)
            job.keep = [stage]
            job.recvs = [
                (self.comm.Irecv(stage[a:b], src, _payload(tag)), a, b)
                for a, b in _chunks(0, len(stage), 4 * CHUNK)
            ]
        else:  # PUSH, PUSH_PULL, WRITE, OUTER: receive the chunks into a staging buffer, apply each as it lands
            stage = np.empty(n, dtype=np.float32)
            job.keep = [stage]
            lo = start - box.my_start
            job.recvs = [
                (self.comm.Irecv(stage[a:b], src, _payload(tag)), lo + a, lo + b) for a, b in _chunks(0, n)
            ]
        self.jobs.append(job)

    def _unpark(self, sweep: bool) -> bool:
        """Start the parked pulls whose pushes have landed (looked at once a keyed push has landed since
        the last look, or on a ``sweep``); on a sweep, drop those past their deadline."""
        if not self.parked:
            return False
        arrivals = self.box.arrivals
        if arrivals == self._seen_arrivals and not sweep:
            return False
        self._seen_arrivals = arrivals
        parked, self.parked, now = self.parked, [], time.monotonic()
        for job in parked:
            if self.box.landed(int(job.header[4]), int(job.header[5])):
                self._start(job.src, job.header)
            elif sweep and now > job.deadline:
                self._drop(job, f"its pushes did not all land within {self.box.timeout:.0f} s")
            else:
                self.parked.append(job)
        return len(self.parked) < len(parked)

    def _progress(self, sweep: bool) -> bool:
        """Advance the jobs whose next receive has landed or whose replies are going out; True if
        anything moved. On a ``sweep``, every job, and those past their deadline are dropped."""
        moved, now = False, time.monotonic()
        for job in self._due(sweep):
            try:
                moved = self._advance(job) or moved
                done = job.next == len(job.recvs) and MPI.Request.Testall(job.sends)
            except MPI.Exception as e:
                if _failure_class(e) is None:
                    raise
                self.jobs.remove(job)
                self._drop(job, "its peer failed")
                continue
            if done:
                self.jobs.remove(job)
            elif sweep and now > job.deadline:
                self.jobs.remove(job)
                self._drop(job, f"no progress within {self.box.timeout:.0f} s")
        return moved

    def _due(self, sweep: bool) -> list[_Job]:
        """The jobs to advance now: with replies going out, or whose next receive has landed (one
        ``Testsome`` over them all, not a look a job), or all of them on a ``sweep`` or where MPI
        raised (a peer's failure: each job then meets it on its own)."""
        if sweep:
            return list(self.jobs)
        waiting = [job for job in self.jobs if job.next < len(job.recvs)]
        due = [job for job in self.jobs if job.next == len(job.recvs)]
        if not waiting:
            return due
        try:
            landed = MPI.Request.Testsome([job.recvs[job.next][0] for job in waiting])
        except MPI.Exception as e:
            if _failure_class(e) is None:
                raise
            return list(self.jobs)
        return due + [waiting[i] for i in landed or ()]

    def _advance(self, job: _Job) -> bool:
        moved = False
        box = self.box
        stage = job.keep[0] if job.recvs else None
        while job.next < len(job.recvs) and job.recvs[job.next][0].Test():
            _, lo, hi = job.recvs[job.next]
            src = stage[(lo - job.recvs[0][1]) :][: hi - lo]
            op = int(job.header[0])
            job.next += 1
            moved = True
            if op in _CODED:
                if job.next == len(job.recvs):
                    self._apply_coded(job, stage)
                continue
            if op == OUTER:  # staged, its theta sent back at once; committed whole when its last chunk lands
                staged = box.outer_staged(job.header, lo, hi, src)
                job.keep.append(staged)
                job.staged.append((lo, hi, staged))
                if job.next == len(job.recvs):
                    box.commit_outer(job.staged)
                job.sends.append(self.comm.Isend(staged[0], job.src, _reply(int(job.header[1]))))
                continue
            box.apply(job.header, lo, hi, src)
            if op == PUSH_PULL:  # the chunk as this push left it, straight from the shard (a pull)
                job.sends.append(self.comm.Isend(box.shard[lo:hi], job.src, _reply(int(job.header[1]))))
            elif op == ELASTIC:  # the staged chunk, now x - c as it was
                job.sends.append(self.comm.Isend(src, job.src, _reply(int(job.header[1]))))
            elif job.next == len(job.recvs):  # applied: the ack completes the client's push
                ack = np.ones(1, dtype=np.int64)
                job.keep.append(ack)
                job.sends.append(self.comm.Isend(ack, job.src, _reply(int(job.header[1]))))
        return moved

    def _apply_coded(self, job: _Job, message: np.ndarray) -> None:
        """An encoded push or outer step whose bytes have all landed: decoded, applied; then the new values'
        chunks (a push-pull, an outer step), or the ack."""
        tag = int(job.header[1])
        back = self.box.apply_coded(job.header, message)
        if back is not None:
            job.keep.append(back)
            job.sends += [self.comm.Isend(back[a:b], job.src, _reply(tag)) for a, b in _chunks(0, len(back))]
        else:
            ack = np.ones(1, dtype=np.int64)
            job.keep.append(ack)
            job.sends.append(self.comm.Isend(ack, job.src, _reply(tag)))

    def _drop(self, job: _Job, why: str) -> None:
        self.dropped += 1
        _cancel([r for r, _, _ in job.recvs[job.next :]])
        if self.dropped == 1:
            warnings.warn(f"box {self.box.name!r}: dropped a request of rank {job.src} ({why})", stacklevel=2)


class ServerBox(ParameterBox):
    """An rma box whose box ranks serve requests (``open_box("rma", world, ..., server=True)``).

    >>> box = open_box("rma", World.from_env(), numel=10**6, memory_ranks=1, server=True)  # doctest: +SKIP
    >>> box.push(delta, scale=0.5)  # one trip over the link; the memory rank adds  # doctest: +SKIP
    """

    backend = "rma"

    def __init__(
        self, comm: MPI.Comm, name: str, numel: int, num_counters: int, box_ranks: list[int], timeout: float
    ):
        self._setup_common(comm, name, numel, num_counters, box_ranks, timeout)
        self.data = self.comm.Dup()  # requests and replies: never mixed with the box's barriers
        self.data.Set_errhandler(MPI.ERRORS_RETURN)
        self.tag_ub = int(self.comm.Get_attr(MPI.TAG_UB) or 32767)
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self.lock = threading.Lock()  # the shard's: the server's applies and this rank's own
        self._companion_lock = threading.Lock()
        mine = [k for k, r in enumerate(box_ranks) if r == self.rank]
        self.my_start, my_stop = self.shards[mine[0]] if mine else (0, 0)
        self.shard = np.zeros(my_stop - self.my_start, dtype=np.float32)
        ncount = num_counters if self.rank == self.counter_rank else 0
        self.counters = np.zeros(ncount, dtype=np.int64)
        self._companion: np.ndarray | None = None  # (m, a) per element of the shard: the outer step's
        self.arrived: dict[int, int] = {}  # elements pushed under each key (gated pulls), under the lock
        self.arrivals = 0  # keyed pushes applied so far: the server looks at its parked pulls when it moves
        # A once-only push-pull's last applied sequence number per (origin, chunk), under the lock
        self.applied: dict[tuple[int, int], int] = {}
        self.payload_bytes = 0  # bytes of pushes, writes and encoded pushes this client sent to other ranks
        self.server = _Server(self) if mine or ncount else None
        if self.server is not None:
            self.server.start()
        self.barrier()

    def _setup_common(self, comm, name, numel, num_counters, box_ranks, timeout) -> None:
        super().__init__(name, numel, num_counters, timeout)
        self.comm = comm.Dup()  # the box's own barriers never mix with the caller's messages
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.fault_tolerant = pbmpi.fault_tolerant()
        self.box_ranks = box_ranks
        self.shards = [shard_range(numel, k, len(box_ranks)) for k in range(len(box_ranks))]
        self.rank = self.comm.Get_rank()
        # A process that holds no shard may exit while the box lives on (memory ranks).
        self.outlives_processes = self.rank not in box_ranks
        self.counter_rank = box_ranks[0]
        self._failed: set[int] = set()

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open()
        wait_request(
            self.comm.Ibarrier(), self.timeout if timeout is None else timeout, f"box {self.name!r} barrier"
        )

    def failed_ranks(self) -> list[int]:
        """Ranks of the box known dead (under ``--with-ft ulfm``; empty otherwise)."""
        if self.fault_tolerant and not self._closed:
            self._failed.update(pbmpi.failed_ranks(self.comm))
        return sorted(self._failed)

    @contextlib.contextmanager
    def peer_failures(self, what: str) -> Iterator[None]:
        """MPI's "a peer failed" in a request to the box's ranks as ``BoxLost``, naming the dead rank
        that held part of the box (or its counters) and what a run can do about it."""
        try:
            yield
        except MPI.Exception as e:
            failed = _failure_class(e) is not None
            if not failed and e.Get_error_class() != MPI.ERR_IN_STATUS:
                raise
            dead = sorted(set(self.failed_ranks()) & set(self.box_ranks))
            if not (failed or dead):  # (of several requests', one's error: not a failed peer)
                raise
            who = f"rank {', '.join(map(str, dead))}" if dead else "a rank of the box"
            raise BoxLost(
                f"{what}: {who} died, and the part of the box it held went with it",
                "Across nodes the box is held by its memory ranks (box.memory_ranks) or, without them, by the "
                "workers: either's death ends the run, each surviving worker keeping its replica; --resume "
                "(or --max-restarts N, at once) continues an asynchronous run, its box rebuilt from them",
            ) from None

    def apply(self, header: np.ndarray, lo: int, hi: int, src: np.ndarray) -> None:
        """Request ``header``'s operation on ``shard[lo:hi]``, under the shard's lock: ``+= scale * src``
        (PUSH, PUSH_PULL), ``= src`` (WRITE, COMPANION_WRITE into companion row ``header[4]``), or
        the outer step with pseudo-gradient ``src`` (OUTER), or ``src <- src - shard; shard += scale * src``
        (ELASTIC: ``src``, a replica's values, becomes their difference from the center, the answer)."""
        op, floats = int(header[0]), header[5:].view(np.float64)
        if op == OUTER:
            self._outer(lo, hi, src, int(header[4]), *floats[:5])
            return
        if op == ELASTIC:
            e, c = torch.from_numpy(src), torch.from_numpy(self.shard[lo:hi])
            with self.lock:
                e.sub_(c)
                c.add_(e, alpha=float(floats[0]))
            return
        with self.lock:
            if (
                op == PUSH_PULL and header[4] > 0
            ):  # once-only: a chunk resent under its sequence number is not
                chunk, seq = (int(header[4]), lo), int(floats[1])  # applied again (its pull still answers)
                if self.applied.get(chunk) == seq:
                    return
                self.applied[chunk] = seq
            if op == PUSH and header[4] > 0:  # a keyed push: count what landed
                key = int(header[4]) - 1
                self.arrived[key] = self.arrived.get(key, 0) + hi - lo
                self.arrivals += 1
            if op == WRITE:
                np.copyto(self.shard[lo:hi], src)
            elif op == COMPANION_WRITE:
                np.copyto(self.companion()[int(header[4]), lo:hi], src)
            else:  # one pass, no temporary for scale * src (box-sync pushes g / n every step)
                torch.from_numpy(self.shard[lo:hi]).add_(torch.from_numpy(src), alpha=float(floats[0]))

    def landed(self, key: int, target: int) -> bool:
        """Whether ``target`` elements have been pushed under ``key`` into this rank's shard."""
        with self.lock:
            return self.arrived.get(key, 0) >= target

    def companion(self) -> np.ndarray:
        """The outer step's (m, a) beside every element of this rank's shard (zeros at first)."""
        with self._companion_lock:
            if self._companion is None:
                self._companion = np.zeros((2, len(self.shard)), dtype=np.float32)
            return self._companion

    def _outer(self, lo: int, hi: int, g: np.ndarray, flags: int, lr, beta, inv_n, k, k_last) -> None:
        """The outer step on ``[lo, hi)`` at once (this rank's own arrival: no message to be cut)."""
        with self.lock:
            self._commit(lo, hi, self._outer_values(lo, hi, g, flags, lr, beta, inv_n, k, k_last))

    def _outer_values(self, lo, hi, g, flags, lr, beta, inv_n, k, k_last) -> np.ndarray:
        """The outer step's new ``[theta, m, a]`` on ``[lo, hi)``, computed aside (a scratch, not the shard);
        ``flags``: bit 0 the arrival closes a block (a step), bit 1 the quorum rule (``_quorum_values``)."""
        last = bool(flags & 1)
        if flags & QUORUM:
            return self._quorum_values(lo, hi, g, last, lr, beta, inv_n)
        m, a = self.companion()[:, lo:hi]
        out = np.empty((3, hi - lo), dtype=np.float32)
        new_theta, new_m, new_a = out
        step = g * np.float32(inv_n)
        np.add(a, step, out=new_a)
        if last:
            np.multiply(m, np.float32(beta), out=new_m)
            new_m += new_a
            new_a[:] = 0
            step += np.float32(k_last) * new_m
        else:
            new_m[:] = m
            if k:
                step += np.float32(k) * new_m
        np.subtract(self.shard[lo:hi], np.float32(lr) * step, out=new_theta)
        return out

    def _quorum_values(self, lo, hi, g, last, lr, beta, share) -> np.ndarray:
        """The quorum rule's ``[theta, m, a]`` (``strategies/delayed_nesterov.py``, ``QuorumNesterov``):
        ``a`` the weighted mean of the pending arrivals, ``a + share (g - a)``; a closing arrival applies
        the Nesterov step on it, ``m <- beta m + a; theta -= lr (a + beta m); a <- 0``; theta stays put
        otherwise."""
        m, a = self.companion()[:, lo:hi]
        out = np.empty((3, hi - lo), dtype=np.float32)
        new_theta, new_m, new_a = out
        np.subtract(g, a, out=new_a)
        new_a *= np.float32(share)
        new_a += a
        if not last:
            new_theta[:] = self.shard[lo:hi]
            new_m[:] = m
            return out
        np.multiply(m, np.float32(beta), out=new_m)
        new_m += new_a
        new_a += np.float32(beta) * new_m  # the step's direction
        np.subtract(self.shard[lo:hi], np.float32(lr) * new_a, out=new_theta)
        new_a[:] = 0
        return out

    def _commit(self, lo: int, hi: int, values: np.ndarray) -> None:
        self.shard[lo:hi] = values[0]
        self.companion()[:, lo:hi] = values[1:]

    def outer_staged(self, header: np.ndarray, lo: int, hi: int, g: np.ndarray) -> np.ndarray:
        """A remote arrival's outer step on one chunk, computed aside: its ``[theta, m, a]``."""
        floats = header[5:].view(np.float64)
        with self.lock:
            return self._outer_values(lo, hi, g, int(header[4]), *floats[:5])

    def commit_outer(self, staged: list[tuple[int, int, np.ndarray]]) -> None:
        """Every chunk of an arrival's outer step into the shard and its companions, at once: an arrival
        whose sender died before its last chunk landed is applied to no element of this shard."""
        with self.lock:
            for lo, hi, values in staged:
                self._commit(lo, hi, values)

    def apply_coded(self, header: np.ndarray, message: np.ndarray) -> np.ndarray | None:
        """An encoded request on this rank's shard: ``decode_push`` of the message (``_coded_fields``), then
        ``+= scale *`` the values (``PUSH_CODED``, ``PUSH_PULL_CODED``: the header's ``counter`` the code,
        its floats ``scale, nbytes, *params``) or the outer step with them as pseudo-gradient, applied at
        once (``OUTER_CODED``: ``counter`` the flags plus ``code << 2``, floats the five coefficients, then
        ``nbytes, *params``). Returns the range's new values to send back (None for a plain push)."""
        op, lo, n = int(header[0]), int(header[2]) - self.my_start, int(header[3])
        code, _, params = _coded_fields(header)
        values = decode_push(code, torch.from_numpy(message), n, params)
        floats = header[5:].view(np.float64)
        if op == OUTER_CODED:
            with self.lock:
                new = self._outer_values(
                    lo, lo + n, values.numpy(), int(header[4]) & _OUTER_FLAGS, *floats[:5]
                )
                self._commit(lo, lo + n, new)
            return new[0]
        with self.lock:
            torch.from_numpy(self.shard[lo : lo + n]).add_(values, alpha=float(floats[0]))
        return self.shard[lo : lo + n] if op == PUSH_PULL_CODED else None

    # -- the client side ------------------------------------------------------------------------
    def _tag(self) -> int:
        with self._tag_lock:
            return _FIRST_TAG + next(self._tags) % (self.tag_ub // 2 - _FIRST_TAG)

    def _pieces_by_shard(self, start: int, stop: int):
        """Remote shards first, this rank's own last: a request that leaves later can queue behind
        the bulk data its server already sends the same peer (one TCP stream per pair of ranks)."""
        pieces = [
            (self.box_ranks[k], max(start, s0), min(stop, s1)) for k, (s0, s1) in enumerate(self.shards)
        ]
        pieces = [p for p in pieces if p[1] < p[2]]
        return sorted(pieces, key=lambda p: p[0] == self.rank)

    def _transfer(
        self,
        op: int,
        buf: np.ndarray,
        start: int,
        scale: float = 1.0,
        out: np.ndarray | None = None,
        counter: int = 0,
        more: tuple[float, ...] = (),
    ) -> Handle:
        """``op`` on ``buf`` (``out``: where a push-pull's values land) over every shard it spans;
        ``counter`` and ``scale, *more`` fill the header's int and float fields."""
        reqs, keep = [], []
        answers = op in (PULL, PUSH_PULL, OUTER, COMPANION_PULL, ELASTIC)
        for rank, lo, hi in self._pieces_by_shard(start, start + len(buf)):
            part = buf[lo - start : hi - start]
            back = part if out is None else out[lo - start : hi - start]
            header = request_header(op, lo, hi - lo, counter, scale, *more)
            if rank == self.rank:  # this rank's own shard: no message
                mine = slice(lo - self.my_start, hi - self.my_start)
                if op == ELASTIC:  # x - c into the answer, c moved, under the lock
                    np.copyto(back, part)
                    self.apply(header, mine.start, mine.stop, back)
                    continue
                if op == PUSH_PULL and counter > 0:  # once-only: chunk by chunk, as a remote request lands
                    for a, b in _chunks(0, hi - lo):
                        self.apply(header, mine.start + a, mine.start + b, part[a:b])
                elif op not in (PULL, COMPANION_PULL):
                    self.apply(header, mine.start, mine.stop, part)
                if answers:
                    whole = self.companion()[counter] if op == COMPANION_PULL else self.shard
                    np.copyto(back, whole[mine])
                continue
            header[1] = tag = self._tag()
            if answers:
                reqs += [self.data.Irecv(back[a:b], rank, _reply(tag)) for a, b in _chunks(0, hi - lo)]
            else:
                ack = np.zeros(1, dtype=np.int64)
                keep.append(ack)
                reqs.append(self.data.Irecv(ack, rank, _reply(tag)))
            keep.append(header)
            reqs.append(self.data.Isend(header, rank, REQUEST_TAG))
            if op not in (PULL, COMPANION_PULL):
                reqs += [self.data.Isend(part[a:b], rank, _payload(tag)) for a, b in _chunks(0, hi - lo)]
                self.payload_bytes += part.nbytes
        return _Requests(reqs, [*keep, buf, out], self, f"box {self.name!r}")

    gated = True  # push_keyed_async / pull_when_async

    def push_keyed_async(self, src: torch.Tensor, scale: float, start: int, key: int) -> Handle:
        """``push_async`` whose elements the shard's server counts under ``key`` (>= 0); the range
        lies in one shard."""
        flat = _host_flat(src)
        self._span(flat.numel(), start)
        return self._transfer(PUSH, flat.numpy(), start, scale, counter=key + 1)

    def pull_when_async(self, out: torch.Tensor, start: int, key: int, target: int) -> Handle:
        """``pull_async`` of ``out.numel()`` elements at ``start`` (one shard) once ``target`` elements
        have been pushed under ``key`` there: the server parks the request until then."""
        assert _is_host_flat(out)
        self._span(out.numel(), start)
        ((rank, lo, hi),) = self._pieces_by_shard(start, start + out.numel())
        if rank == self.rank:
            return _LocalGated(self, out.numpy(), lo - self.my_start, key, target)
        header = np.zeros(_HEADER, dtype=np.int64)
        header[:6] = [PULL_WHEN, tag := self._tag(), lo, hi - lo, key, target]
        back = out.numpy()
        reqs = [self.data.Irecv(back[a:b], rank, _reply(tag)) for a, b in _chunks(0, hi - lo)]
        reqs.append(self.data.Isend(header, rank, REQUEST_TAG))
        return _Requests(reqs, [header, back], self, f"box {self.name!r} gated pull")

    decodes_pushes = True

    def code_pieces(self, start: int, n: int) -> list[tuple[int, int]]:
        """One range a shard: each shard's server decodes its own message."""
        return sorted((lo, hi) for _, lo, hi in self._pieces_by_shard(start, start + n))

    def push_encoded_async(
        self,
        messages: Sequence[torch.Tensor],
        n: int,
        code: int,
        params: tuple[float, ...],
        scale: float = 1.0,
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> Handle:
        """The messages' bytes go to their shards' servers, which decode and add them (this rank's own
        shard: decoded here); with ``out``, each server sends its shard back once it has applied the push.
        At most two floats of ``params``."""
        op = PUSH_CODED if out is None else PUSH_PULL_CODED
        return self._coded(op, messages, n, start, out, code, (scale,), params)

    def outer_step_encoded_async(
        self,
        messages: Sequence[torch.Tensor],
        n: int,
        code: int,
        params: tuple[float, ...],
        out: torch.Tensor,
        coefficients: tuple[float, ...],
        last: int,
        start: int = 0,
    ) -> Handle:
        """``outer_step_async`` of the pseudo-gradient the messages encode, one a range of ``code_pieces``
        (``code``, ``params``: as ``push_encoded_async``): each shard's server decodes its message, then
        applies the outer step with it; ``out`` holds the new theta once the handle's ``wait()`` returns."""
        assert len(coefficients) == 5, "an outer step's coefficients: (lr, beta, 1 / N or share, k, k_last)"
        flags = int(last)
        assert 0 <= flags <= _OUTER_FLAGS
        return self._coded(OUTER_CODED, messages, n, start, out, flags | code << 2, coefficients, params)

    def _coded(
        self,
        op: int,
        messages: Sequence[torch.Tensor],
        n: int,
        start: int,
        out: torch.Tensor | None,
        counter: int,
        lead: tuple[float, ...],
        params: tuple[float, ...],
    ) -> Handle:
        """An encoded request (``op`` in ``_CODED``) over the shards of ``[start, start + n)``, one message
        each; ``lead``: the header's floats before the message's bytes and ``params``; ``out``: where the
        new values come back (None: an ack)."""
        self._span(n, start)
        assert len(params) <= 2, "an encoding's params: at most two floats"
        got = None if out is None else (out.view(-1) if _is_host_flat(out) else torch.empty(n))
        back = None if got is None else got.numpy()
        pieces = dict(zip(self.code_pieces(start, n), messages))
        assert len(pieces) == len(messages), "one message per code piece"
        reqs, keep = [], [back]
        for rank, lo, hi in self._pieces_by_shard(start, start + n):
            msg = pieces[(lo, hi)].to("cpu").contiguous().numpy()
            header = request_header(op, lo, hi - lo, counter, *lead, float(len(msg)), *params)
            part = None if back is None else back[lo - start : hi - start]
            if rank == self.rank:  # this rank's own shard: no message
                new = self.apply_coded(header, msg)
                if part is not None:
                    np.copyto(part, new)
                continue
            header[1] = tag = self._tag()
            if part is not None:
                reqs += [self.data.Irecv(part[a:b], rank, _reply(tag)) for a, b in _chunks(0, hi - lo)]
            else:
                ack = np.zeros(1, dtype=np.int64)
                keep.append(ack)
                reqs.append(self.data.Irecv(ack, rank, _reply(tag)))
            keep += [header, msg]
            reqs.append(self.data.Isend(header, rank, REQUEST_TAG))
            reqs += [
                self.data.Isend(msg[a:b], rank, _payload(tag)) for a, b in _chunks(0, len(msg), 4 * CHUNK)
            ]
            self.payload_bytes += msg.nbytes
        handle = _Requests(reqs, keep, self, f"box {self.name!r}")
        return handle if out is None or _is_host_flat(out) else _StagedPull(handle, got, out)

    def _pull_into(self, out: torch.Tensor, start: int) -> Handle:
        return self._transfer(PULL, out.numpy(), start)

    def _push_from(self, src: torch.Tensor, scale: float, start: int) -> Handle:
        return self._transfer(PUSH, src.numpy(), start, scale)

    def _write_from(self, src: torch.Tensor, start: int) -> None:
        self._transfer(WRITE, src.numpy(), start).wait()

    def _push_pull(self, src: torch.Tensor, out: torch.Tensor, scale: float, start: int) -> Handle:
        return self._transfer(PUSH_PULL, src.numpy(), start, scale, out=out.numpy())

    fuses_elastic = True

    def _elastic(self, x: torch.Tensor, out: torch.Tensor, alpha: float, start: int) -> Handle:
        return self._transfer(ELASTIC, x.numpy(), start, alpha, out=out.numpy())

    once = True  # push_pull_once

    def push_pull_once(self, delta: torch.Tensor, out: torch.Tensor, origin: int, seq: int) -> torch.Tensor:
        """``push_pull(delta, out)`` from ``[0, n)`` that counts each chunk once per ``(origin, seq)``: a
        resend of the same update under the same ``origin`` (> 0) and ``seq`` adds only the chunks that had
        not landed (the node cache's sync cut by a death, resent by a node-mate); every chunk's pull answers.
        Host float32 tensors, flat and contiguous."""
        if origin <= 0:
            raise ValueError(f"box {self.name!r}: push_pull_once needs an origin > 0, not {origin}")
        self._span(delta.numel(), 0)
        self._transfer(
            PUSH_PULL, delta.numpy(), 0, 1.0, out=out.numpy(), counter=origin, more=(float(seq),)
        ).wait()
        return out

    # -- asynchronous DiLoCo's outer step (see the module's docstring) --------------------------------
    fuses_outer_step = True

    def outer_step_async(
        self, g: torch.Tensor, out: torch.Tensor, coefficients: tuple[float, ...], last: bool, start: int = 0
    ) -> Handle:
        """Start the outer step of one arrival with pseudo-gradient ``g`` on ``box[start:start + n]``;
        ``out`` holds the new theta once the handle's ``wait()`` returns. ``coefficients``: ``(lr,
        beta, 1 / N, k, k_last)``; ``last``: the arrival closes its block (the momentum moves). With the
        quorum rule (``last`` with ``QUORUM`` set, bit 0 still closing): ``(lr, beta, share, 0, 0)``."""
        src = _host_flat(g)
        self._span(src.numel(), start)
        got = out.view(-1) if _is_host_flat(out) else torch.empty(out.numel())
        handle = self._transfer(
            OUTER, src.numpy(), start, coefficients[0], got.numpy(), int(last), coefficients[1:]
        )
        return handle if _is_host_flat(out) else _StagedPull(handle, got, out)

    def pull_companion(self, out: torch.Tensor, row: int, start: int = 0) -> torch.Tensor:
        """``out <- m`` (``row`` 0) or ``a`` (1) of the elements ``[start, start + n)``."""
        self._span(out.numel(), start)
        self._transfer(COMPANION_PULL, out.view(-1).numpy(), start, counter=row).wait()
        return out

    def write_companion(self, src: torch.Tensor, row: int, start: int = 0) -> None:
        flat = _host_flat(src)
        self._span(flat.numel(), start)
        self._transfer(COMPANION_WRITE, flat.numpy(), start, counter=row).wait()

    def add_counter_async(self, i: int, v: int) -> Count:
        i = self._counter_index(i)
        if self.rank == self.counter_rank:
            with self.lock:
                old = int(self.counters[i])
                self.counters[i] += v
            return Count(old)
        tag = self._tag()
        header = np.zeros(_HEADER, dtype=np.int64)
        header[:6] = [COUNTER, tag, 0, 0, i, v]
        return _RemoteCount(self, header, i)

    def read_counter(self, i: int) -> int:
        return self.add_counter_async(i, 0).wait()

    def add_counter(self, i: int, v: int) -> int:
        return self.add_counter_async(i, v).wait()

    def close(self) -> None:
        """Collective over the live ranks: once all are here no request can come, so the server stops."""
        if self._closed:
            return
        try:
            if self.fault_tolerant:
                pbmpi.ft_barrier(self.comm, min(self.timeout, 60.0), f"closing box {self.name!r}")
            else:
                self.barrier(timeout=min(self.timeout, 10.0))
        except CommTimeout:
            warnings.warn(
                f"box {self.name!r}: a peer did not close the box; stopping its server", stacklevel=2
            )
            self._stop_server()
            return
        finally:
            self._closed = True
        self._stop_server()
        self.data.Free()
        self.comm.Free()

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
