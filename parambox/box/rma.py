"""The ``rma`` box: any number of nodes, MPI-3 one-sided windows through mpi4py.

Where the box lives. ``memory_ranks=K`` (the default of the asynchronous strategies): the last K
ranks hold the box, one shard each, and do no training - the Soft Memory Box's memory node (a dead
worker then takes no part of the box with it; a shard on a worker would die with it, and across
nodes a ``Flush`` to a dead rank never returns, so neither replicas nor shards on workers can be
failed over). Otherwise on the workers themselves: the buffer is cut into ``num_shards`` near-equal
shards (``shard_range``); shard ``k`` is the window memory of box rank ``box_ranks[k]``, by default
``k * size // num_shards``, and ``num_shards`` defaults to every rank, so under ``mpiexec -n N`` each
worker holds ``1/N`` of the box, as DistBelief sharded its parameter server. ``num_shards=1`` puts
the whole box on rank 0 (a classic parameter server). The int64 counters live in a small window on
``box_ranks[0]``.

By the MPI-3 book: every rank keeps a passive-target epoch open on both windows (``Lock_all``
once) and completes each operation with ``Flush``; a push is one ``Accumulate(SUM)`` per shard it
touches (concurrent accumulates with the same op are atomic per element); a pull is
``Get_accumulate(NO_OP)``, the atomic read (a plain ``Get`` racing an ``Accumulate`` on the same
location is a conflicting access, undefined); a counter add is ``Fetch_and_op``. A write is an
``Accumulate(REPLACE)``, which MPI does not promise to be atomic against concurrent ``SUM``s (the
``accumulate_ops`` info allows same-op or no-op only), so writes happen only where no push can run
(the initial and the resumed center, before anyone pushes). Windows are created with
``accumulate_ordering=none`` (Open MPI reads it as ``accumulate_order``; both are set): no ordering
between accumulates is needed.

Under ``mpiexec --with-ft ulfm`` (``runtime/mpi.py``) the box survives a worker's death: a box rank
reports dead ranks (``failed_ranks``) and ``close`` ends with a fault-tolerant barrier. One hazard
remains, in Open MPI rather than here: an accumulate holds a per-target lock for the whole call, so
a rank killed *inside* one (an external SIGKILL landing in that window) can leave the others
spinning on that target for good; parambox's own fault injection never does.

mpi4py is imported here only, because importing it initialises MPI.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from parambox.runtime import mpi as pbmpi

pbmpi.before_import()
from mpi4py import MPI  # noqa: E402  (importing it initialises MPI)

from parambox.box.base import Count, Handle, ParameterBox, wait_until  # noqa: E402
from parambox.box.layout import shard_range  # noqa: E402
from parambox.errors import CommTimeout, UserError  # noqa: E402
from parambox.runtime.world import World  # noqa: E402

T = TypeVar("T")

# MPI counts are C ints; stay well below 2**31 elements (and bytes) per call.
MAX_CHUNK = 1 << 26
_NAME_BYTES = 64


class _Flush(Handle):
    """Completes RMA operations at their targets when waited on."""

    def __init__(self, win: MPI.Win, targets: list[int], keep: object = None):
        self.win, self.targets, self.keep = win, targets, keep

    def wait(self) -> None:
        for t in self.targets:
            self.win.Flush(t)
        self.targets, self.keep = [], None


class _FetchedCount(Count):
    """A ``Fetch_and_op`` in flight; its ``Flush`` on ``wait``."""

    def __init__(self, win: MPI.Win, target: int, i: int, v: int):
        super().__init__()
        self.win, self.target = win, target
        self.src, self.result = np.array([v], dtype=np.int64), np.zeros(1, dtype=np.int64)
        win.Fetch_and_op(self.src, self.result, target, i, MPI.SUM)

    def wait(self) -> int:
        if self.win is not None:
            self.win.Flush(self.target)
            self.win, self.value = None, int(self.result[0])
        return self.value


class RmaBox(ParameterBox):
    """A box sharded over MPI windows; build it with ``open_box("rma", world, ...)`` under mpiexec.

    >>> box = open_box("rma", World.from_env(), numel=10**6, num_shards=2)  # doctest: +SKIP
    >>> h = box.push_async(delta); ...; h.wait()  # doctest: +SKIP
    """

    backend = "rma"

    def __init__(
        self, comm: MPI.Comm, name: str, numel: int, num_counters: int, box_ranks: list[int], timeout: float
    ):
        super().__init__(name, numel, num_counters, timeout)
        # The box's own communicator: its barriers never mix with the caller's messages.
        self.comm, request = comm.Idup()
        wait_request(request, timeout, f"box {name!r}: duplicating the communicator")
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.fault_tolerant = pbmpi.fault_tolerant()
        self.box_ranks = box_ranks
        self.shards = [shard_range(numel, k, len(box_ranks)) for k in range(len(box_ranks))]
        rank = self.comm.Get_rank()
        # A process that holds no shard may exit while the box lives on (memory ranks).
        self.outlives_processes = rank not in box_ranks
        mine = [k for k, r in enumerate(box_ranks) if r == rank]
        local = 0 if not mine else self.shards[mine[0]][1] - self.shards[mine[0]][0]
        info = _window_info()
        what = f"box {name!r}: allocating its windows"
        self.win = bounded(lambda: MPI.Win.Allocate(local * 4, 4, info=info, comm=self.comm), timeout, what)
        self.counter_rank = box_ranks[0]
        ncount = num_counters if rank == self.counter_rank else 0
        self.cwin = bounded(lambda: MPI.Win.Allocate(ncount * 8, 8, info=info, comm=self.comm), timeout, what)
        info.Free()
        for win in (self.win, self.cwin):
            win.Set_errhandler(MPI.ERRORS_RETURN)  # a window's MPI default is ERRORS_ARE_FATAL
        self._failed: set[int] = set()
        # Window memory is not zeroed by MPI; zero it before anyone can reach it (barrier below).
        if local:
            np.frombuffer(self.win.tomemory(), dtype=np.float32)[:] = 0
        if ncount:
            np.frombuffer(self.cwin.tomemory(), dtype=np.int64)[:] = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.cwin.Lock_all(MPI.MODE_NOCHECK)
        self.barrier()

    def _pieces(self, start: int, stop: int):
        """(target rank, target displacement, lo, hi) for each chunk of [start, stop) on each shard."""
        for k, (s0, s1) in enumerate(self.shards):
            lo, hi = max(start, s0), min(stop, s1)
            for a in range(lo, hi, MAX_CHUNK):
                yield self.box_ranks[k], a - s0, a, min(hi, a + MAX_CHUNK)

    def _rma(self, call, buf: torch.Tensor, start: int, **kw) -> list[int]:
        arr = buf.numpy()
        targets: list[int] = []
        for rank, disp, lo, hi in self._pieces(start, start + buf.numel()):
            call([arr[lo - start : hi - start], MPI.FLOAT], rank, target=(disp, hi - lo, MPI.FLOAT), **kw)
            if rank not in targets:
                targets.append(rank)
        return targets

    # -- transfers --------------------------------------------------------------------------------
    def _pull_into(self, out: torch.Tensor, start: int) -> Handle:
        # The atomic read: pushes may run concurrently, and a Get racing them is undefined.
        return _Flush(self.win, self._rma(self._read, out, start))

    def _read(self, result: list, target_rank: int, target: tuple) -> None:
        self.win.Get_accumulate([None, 0, MPI.FLOAT], result, target_rank, target=target, op=MPI.NO_OP)

    def _push_from(self, src: torch.Tensor, scale: float, start: int) -> Handle:
        if scale != 1.0:
            src = torch.mul(src, scale)  # MPI cannot scale; the handle keeps this copy alive
        return _Flush(self.win, self._rma(self.win.Accumulate, src, start, op=MPI.SUM), keep=src)

    def _write_from(self, src: torch.Tensor, start: int) -> None:
        # REPLACE through Accumulate, not Put: atomic per element against concurrent NO_OP reads.
        # Callers write only where no SUM push can run (MPI promises nothing for REPLACE vs SUM).
        _Flush(self.win, self._rma(self.win.Accumulate, src, start, op=MPI.REPLACE)).wait()

    # -- counters ---------------------------------------------------------------------------------
    def _fetch_and_op(self, i: int, v: int, op: MPI.Op) -> int:
        result = np.zeros(1, dtype=np.int64)
        self.cwin.Fetch_and_op(np.array([v], dtype=np.int64), result, self.counter_rank, i, op)
        self.cwin.Flush(self.counter_rank)
        return int(result[0])

    def add_counter_async(self, i: int, v: int) -> Count:
        return _FetchedCount(self.cwin, self.counter_rank, self._counter_index(i), v)

    def read_counter(self, i: int) -> int:
        return self._fetch_and_op(self._counter_index(i), 0, MPI.NO_OP)

    def add_counter(self, i: int, v: int) -> int:
        return self._fetch_and_op(self._counter_index(i), v, MPI.SUM)

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

    def close(self) -> None:
        """Collective over the live ranks. If a peer does not arrive in time the windows are left to
        MPI's exit (which ``finalize_with_deadline`` bounds)."""
        if self._closed:
            return
        try:
            if self.fault_tolerant:  # survivors agree; a plain barrier fails at once after a failure
                pbmpi.ft_barrier(self.comm, min(self.timeout, 60.0), f"closing box {self.name!r}")
            else:
                self.barrier(timeout=min(self.timeout, 10.0))
        except CommTimeout:
            warnings.warn(
                f"box {self.name!r}: a peer did not close the box; leaving its windows", stacklevel=2
            )
            return
        finally:
            self._closed = True
        for win in (self.win, self.cwin):
            win.Unlock_all()
            # Collective: all arrived at the barrier just now, but one may die before it frees.
            bounded(win.Free, min(self.timeout, 10.0), f"box {self.name!r}: freeing its windows")
        self.comm.Free()


def bounded(call: Callable[[], T], timeout: float, what: str) -> T:
    """``call()`` (a blocking MPI collective with no nonblocking form: ``Win.Allocate``, ``Win.Free``),
    given up after ``timeout`` s with a ``CommTimeout``: it runs in a helper thread (the MPI library is
    initialised with MPI_THREAD_MULTIPLE), left blocked behind; ``finalize_with_deadline`` bounds the exit."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return call()  # another thread may not call MPI: no deadline to be had here
    out: list = []

    def run() -> None:
        try:
            out.append((True, call()))
        except BaseException as e:  # handed to the caller's thread
            out.append((False, e))

    helper = threading.Thread(target=run, name="parambox-mpi-call", daemon=True)
    helper.start()
    helper.join(timeout)
    if not out:
        raise CommTimeout(f"{what}: not every rank arrived within {timeout:.0f} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def wait_request(req: MPI.Request, timeout: float, what: str) -> None:
    wait_until(req.Test, timeout, lambda: f"{what}: not every rank arrived within {timeout:.0f} s")


def _window_info() -> MPI.Info:
    info = MPI.Info.Create()
    # No ordering between accumulates is needed; Open MPI reads the standard key as accumulate_order.
    info.Set("accumulate_ordering", "none")
    info.Set("accumulate_order", "none")
    return info


def _box_ranks(
    size: int, num_shards: int | None, box_ranks: Sequence[int] | None, memory_ranks: int | None = None
) -> list[int]:
    if memory_ranks:
        if memory_ranks >= size:
            raise UserError(
                f"box.memory_ranks={memory_ranks}: the run has {size} ranks, and at least one must train"
            )
        return list(range(size - memory_ranks, size))
    if box_ranks is not None:
        ranks = [int(r) for r in box_ranks]
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
            raise UserError(f"box_ranks {ranks}: need distinct ranks in [0, {size})")
        return ranks
    num_shards = size if num_shards is None else num_shards
    if not 1 <= num_shards <= size:
        raise UserError(f"num_shards={num_shards}: need 1 <= num_shards <= {size} (ranks of the run)")
    return [k * size // num_shards for k in range(num_shards)]


def _check_agreement(comm: MPI.Comm, name: str, fields: list[int], timeout: float) -> None:
    """Every rank must open the same box: same name, size, counters, layout and shard placement."""
    rec = np.zeros(_NAME_BYTES + 8 * len(fields), dtype=np.uint8)
    rec[: len(name)] = np.frombuffer(name.encode(), dtype=np.uint8)
    rec[_NAME_BYTES:] = np.array(fields, dtype=np.int64).view(np.uint8)
    everyone = np.zeros((comm.Get_size(), rec.size), dtype=np.uint8)
    wait_request(comm.Iallgather([rec, MPI.BYTE], [everyone, MPI.BYTE]), timeout, f"opening box {name!r}")

    def describe(row: np.ndarray) -> str:
        other = bytes(row[:_NAME_BYTES]).rstrip(b"\0").decode(errors="replace")
        numel, ncount, layout = row[_NAME_BYTES:].view(np.int64)[:3]
        return f"box {other!r} (numel={numel}, num_counters={ncount}, layout={int(layout):#x})"

    for r in range(comm.Get_size()):
        if not np.array_equal(everyone[r], everyone[0]):
            mine, theirs = describe(everyone[0]), describe(everyone[r])
            if mine == theirs:
                theirs += " with another shard placement or server (num_shards, box_ranks, server)"
            raise UserError(f"ranks disagree on box {name!r}: rank 0 opened {mine}, rank {r} opened {theirs}")


def open_rma_box(
    world: World,
    numel: int,
    num_counters: int,
    name: str,
    *,
    layout_hash: int = 0,
    timeout: float = 60.0,
    num_shards: int | None = None,
    box_ranks: Sequence[int] | None = None,
    memory_ranks: int | None = None,
    comm: MPI.Comm | None = None,
    server: bool | None = None,
) -> RmaBox:
    """Collective over ``comm`` (default: every rank of the run). ``server``: the box ranks apply the
    pushes themselves over two-sided messages (``box/server.py``); default: across nodes, where
    Open MPI's one-sided accumulate moves 3x the bytes, and not within one node, where the windows
    are shared memory."""
    comm = MPI.COMM_WORLD if comm is None else comm
    size = comm.Get_size()
    if comm == MPI.COMM_WORLD and size != world.world_size:
        raise UserError(
            f"the rma box needs the run started by mpiexec: MPI sees {size} rank(s), "
            f"the run has {world.world_size}"
        )
    ranks = _box_ranks(size, num_shards, box_ranks, memory_ranks)
    server = world.num_nodes > 1 if server is None else server
    placement = int.from_bytes(
        hashlib.blake2b(repr((ranks, server)).encode(), digest_size=7).digest(), "little"
    )
    _check_agreement(comm, name, [numel, num_counters, layout_hash, placement], timeout)
    if server:
        from parambox.box.server import ServerBox

        return ServerBox(comm, name, numel, num_counters, ranks, timeout)
    return RmaBox(comm, name, numel, num_counters, ranks, timeout)
