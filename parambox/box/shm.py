"""The ``shm`` box: one node, a POSIX shared-memory segment in /dev/shm mapped by every local process.

Segment: ``/dev/shm/<prefix><box name>``, mode 0600. The per-run prefix (``pb_<launcher pid>_<16
random hex>_``) comes from ``PARAMBOX_SHM_PREFIX``, a plain name (set by the local launcher, which
also removes ``<prefix>*`` when the run ends) or, under torchrun/srun/mpiexec, is made by local rank
0 and handed out through the torch.distributed store. Local rank 0 creates the segment
(``O_CREAT|O_EXCL``, space reserved up front so a full /dev/shm is an error now rather than a SIGBUS
later); the others attach and check the header. As soon as every local process has it mapped, the
name is unlinked: the memory lives on while mapped, and nothing is left in /dev/shm even if a
process is SIGKILLed afterwards. Under parambox's own launcher the name stays until the run ends
instead (a replacement of a dead worker attaches by it; the launcher removes the run's segments, its
reaper if it is SIGKILLed).

Memory map: a 4 KiB header, the int64 counters (rounded to 4 KiB), then the float32 data.
Pushes lock stripes of the data with ``fcntl`` byte-range locks on the segment's descriptor: the
kernel drops them when a process dies, so a killed worker never leaves a stripe locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from parambox.box.base import DONE, Handle, ParameterBox, wait_until
from parambox.errors import CommTimeout, UserError
from parambox.runtime.control import RUNNING, WorkerBoard, joins_from, rejoining
from parambox.runtime.spawn import (  # noqa: F401  (re-exported)
    PREFIX_ENV,
    check_prefix,
    new_prefix,
    remove_segments,
)
from parambox.runtime.world import World

SHM_DIR = "/dev/shm"
# Small enough that two pushers rarely wait for each other; big enough that the per-stripe cost
# (lock calls, restarting the add loop) stays ~3 % of a 100 MB push (1 MB stripes cost ~15 % here).
DEFAULT_STRIPE_BYTES = 4 << 20

_PAGE = 4096
_MAGIC = int.from_bytes(b"PBOXSHM1", "little")
# int64 slots of the header
_H_MAGIC, _H_NUMEL, _H_NCOUNT, _H_LAYOUT, _H_STRIPE, _H_EXPECTED = 0, 1, 2, 3, 4, 5
_H_ATTACHED, _H_REJECTED, _H_STATE, _H_BAR_COUNT, _H_BAR_GEN = 6, 7, 8, 9, 10
_READY, _OPEN, _FAILED = 1, 2, 3
_H_ATTACH0 = 64  # slots 64 + local rank: 1 once that local rank has attached
_MAX_LOCAL = _PAGE // 8 - _H_ATTACH0
# byte offsets locked with fcntl (locks need not cover real bytes of the file)
_LOCK_META, _LOCK_COUNTERS, _LOCK_STRIPE0 = 0, 1, 64
_LOCK_EXCLUSIVE0 = 1 << 40  # ``ShmBox.exclusive``'s locks, past any stripe's


def _layout_sizes(numel: int, num_counters: int) -> tuple[int, int]:
    """(byte offset of the data, total bytes of the segment)."""
    data_off = _PAGE + -(-num_counters * 8 // _PAGE) * _PAGE
    return data_off, data_off + numel * 4


class ShmBox(ParameterBox):
    """A box in one shared-memory segment; build it with ``open_box("shm", ...)``.

    >>> box = open_box("shm", World(), numel=1000, num_counters=3, name="center")  # doctest: +SKIP
    >>> Layout.from_model(model).bind_params_(model, box.tensor())  # Hogwild  # doctest: +SKIP
    """

    backend = "shm"
    outlives_processes = True

    def __init__(self, name: str, path: str, fd: int, mm: mmap.mmap, local_rank: int, timeout: float):
        hdr = memoryview(mm)[:_PAGE].cast("q")
        numel, num_counters = hdr[_H_NUMEL], hdr[_H_NCOUNT]
        super().__init__(name, numel, num_counters, timeout)
        self.path, self._fd, self._mm, self._hdr = path, fd, mm, hdr
        data_off, _ = _layout_sizes(numel, num_counters)
        self._counters = memoryview(mm)[_PAGE : _PAGE + num_counters * 8].cast("q")
        self._data = torch.frombuffer(mm, dtype=torch.float32, offset=data_off, count=numel)
        self._np = self._data.numpy()  # the same memory; numpy slices cost less per stripe
        self._stripe = hdr[_H_STRIPE]
        self._expected = hdr[_H_EXPECTED]
        self._local_rank = local_rank
        self._thread_lock = threading.Lock()  # fcntl locks belong to the process, not the thread
        self._exclusive_lock = threading.Lock()

    # -- locks ------------------------------------------------------------------------------------
    def _locked(self, offset: int, phase: str):
        # --timeout and a quarter (at least 1 s): a holder stopped for --timeout is SIGKILLed by the
        # local launcher (its lock goes with it) before a waiter that began just after the stop gives up.
        wait_s = self.timeout + max(1.0, 0.25 * self.timeout)
        return _lock(self._fd, offset, wait_s, lambda: f"box {self.name!r} {phase}")

    @contextlib.contextmanager
    def exclusive(self, key: int = 0, wait: bool = True):
        """Hold lock ``key`` of the box's processes (no stripe's: pushes go on meanwhile); yields True
        once held. ``wait=False``: yields False at once where another process or thread holds it.
        A dead holder's lock goes with it (``fcntl``), as a stripe's does."""
        offset, what = _LOCK_EXCLUSIVE0 + key, f"exclusive lock {key}"
        if not self._exclusive_lock.acquire(wait, self.timeout if wait else -1):
            if wait:
                raise CommTimeout(f"box {self.name!r} {what}: held by this process for {self.timeout:g} s")
            yield False
            return
        try:
            if wait:
                with self._locked(offset, what):
                    yield True
            elif _try_lock(self._fd, offset):
                try:
                    yield True
                finally:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
            else:
                yield False
        finally:
            self._exclusive_lock.release()

    def _stripes(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(stripe, lo, hi) pieces of [start, stop), each process starting at its own stripe."""
        first, last = start // self._stripe, (stop - 1) // self._stripe
        pieces = [
            (s, max(start, s * self._stripe), min(stop, (s + 1) * self._stripe))
            for s in range(first, last + 1)
        ]
        # Two pushers that walk the stripes in the same order queue behind each other; starting at
        # different stripes they mostly work on different ones.
        k = self._local_rank * len(pieces) // max(1, self._expected)
        return pieces[k:] + pieces[:k]

    def _apply(self, dst, src, start: int, op, phase: str) -> None:
        """``op(dst[piece], src[piece])`` for each stripe piece, holding that stripe's lock."""
        with self._thread_lock:
            for s, lo, hi in self._stripes(start, start + len(src)):
                with self._locked(_LOCK_STRIPE0 + s, f"{phase} (stripe {s})"):
                    op(dst[lo:hi], src[lo - start : hi - start])

    # -- transfers --------------------------------------------------------------------------------
    def _pull_into(self, out: torch.Tensor, start: int) -> Handle:
        np.copyto(out.numpy(), self._np[start : start + out.numel()])
        return DONE

    def _push_from(self, src: torch.Tensor, scale: float, start: int) -> Handle:
        if scale == 1.0:  # numpy's add loop ran ~7 % faster than torch's single-thread add_ here
            self._apply(self._np, src.numpy(), start, lambda d, s: np.add(d, s, out=d), "push")
        else:
            self._apply(self._data, src, start, lambda d, s: d.add_(s, alpha=scale), "push")
        return DONE

    def _write_from(self, src: torch.Tensor, start: int) -> None:
        self._apply(self._np, src.numpy(), start, np.copyto, "write")

    def local_view(self) -> torch.Tensor:
        return self._data

    # -- counters ---------------------------------------------------------------------------------
    def read_counter(self, i: int) -> int:
        # An aligned 8-byte load is atomic on the CPUs torch runs on: no lock needed to read.
        return self._counters[self._counter_index(i)]

    def add_counter(self, i: int, v: int) -> int:
        i = self._counter_index(i)
        with self._thread_lock, self._locked(_LOCK_COUNTERS, "counter"):
            old = self._counters[i]
            self._counters[i] = old + v
        return old

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open()
        hdr = self._hdr
        with self._thread_lock, self._locked(_LOCK_META, "barrier"):
            gen = hdr[_H_BAR_GEN]
            hdr[_H_BAR_COUNT] += 1
            if hdr[_H_BAR_COUNT] == self._expected:
                hdr[_H_BAR_COUNT] = 0
                hdr[_H_BAR_GEN] = gen + 1
                return
        wait_until(
            lambda: hdr[_H_BAR_GEN] != gen,
            self.timeout if timeout is None else timeout,
            lambda: (
                f"box {self.name!r} barrier: {hdr[_H_BAR_COUNT]} of {self._expected} local processes "
                f"arrived (a worker died or stalled?)"
            ),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._data = self._np = None
        for view in (self._hdr, self._counters):
            view.release()
        # Never mm.close(): torch.frombuffer keeps the mmap object alive but does not pin it, so
        # closing it would unmap memory under tensors a strategy still holds (Hogwild's parameters).
        # Dropping our references unmaps it once the last such tensor is gone.
        self._mm = None
        os.close(self._fd)


# -- create / attach --------------------------------------------------------------------------------


def open_shm_box(
    world: World,
    numel: int,
    num_counters: int,
    name: str,
    *,
    layout_hash: int = 0,
    timeout: float = 60.0,
    stripe_bytes: int = DEFAULT_STRIPE_BYTES,
) -> ShmBox:
    """Local rank 0 creates the segment, the other local ranks attach; collective over the node.

    Under parambox's launcher a rank that the launcher declares dead or exited is not waited for,
    the segment's name stays until the run ends, and a replacement (life > 0) attaches by it (a
    replacement of local rank 0 takes over the creator's part if the rendezvous still runs).
    Without parambox's launcher the name exists only during the rendezvous."""
    if world.num_nodes > 1:
        raise UserError(f"the shm box spans one node, this run has {world.num_nodes}; use --box rma")
    if not Path(SHM_DIR).is_dir():
        raise UserError(f"the shm box needs {SHM_DIR} (POSIX shared memory); use --box rma")
    if world.local_world_size > _MAX_LOCAL:
        raise UserError(f"the shm box serves at most {_MAX_LOCAL} processes per node")
    path = f"{SHM_DIR}/{_run_prefix(world, timeout)}{name}"
    want = (numel, num_counters, layout_hash)
    board = WorkerBoard.from_env()
    if world.local_rank == 0 and not (rejoining() and os.path.exists(path)):
        try:
            fd, mm = _create(name, path, want, max(1, stripe_bytes // 4), world.local_world_size)
            box = ShmBox(name, path, fd, mm, 0, timeout)
            _finish_rendezvous(box, path, timeout, board)
        except _NameTaken:
            raise  # someone else's segment: not ours to remove
        except BaseException:
            _unlink_quietly(path)  # a signal between creating the name and the rendezvous' own cleanup
            raise
        return box
    fd = _open_by_name(name, path, timeout, board)
    try:
        fd, mm = _attach(name, path, fd, want, world.local_rank, timeout)
    except CommTimeout:
        if world.local_rank > 0:
            _unlink_quietly(path)  # its creator died before writing the header: nobody else would remove it
        raise
    box = ShmBox(name, path, fd, mm, world.local_rank, timeout)
    if world.local_rank == 0:  # a replacement of the creator: finish what it started
        if box._hdr[_H_STATE] == _READY:
            _finish_rendezvous(box, path, timeout, board)
        return box
    try:
        _await_open(box, path, timeout, board)
    except BaseException:
        _unlink_quietly(path)  # the creator may be dead: nobody else would remove the name
        box.close()
        raise
    return box


def _run_prefix(world: World, timeout: float) -> str:
    prefix = os.environ.get(PREFIX_ENV)
    if prefix:
        return check_prefix(prefix)
    if world.local_world_size == 1:
        prefix = new_prefix()
    else:
        prefix = _exchange_prefix(world, timeout)
    os.environ[PREFIX_ENV] = prefix  # later boxes of this run reuse it
    return prefix


def _exchange_prefix(world: World, timeout: float) -> str:
    """Local rank 0 makes the prefix and posts it in the torch.distributed store for its node."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError(
            f"the shm box under {world.launcher} needs {PREFIX_ENV} set or torch.distributed initialised first"
        )
    from torch.distributed.distributed_c10d import _get_default_store

    from parambox.runtime.dist import life_token

    key = f"parambox/shm_prefix/{life_token()}/node{world.node_rank}"  # (not a dead life's key)
    store = _get_default_store()
    if world.local_rank == 0:
        store.set(key, new_prefix())
    store.wait([key], datetime.timedelta(seconds=timeout))
    return store.get(key).decode()


class _NameTaken(UserError):
    """The segment's name exists already: another run's box, which the creator must leave alone."""


def _create(
    name: str, path: str, want: tuple[int, int, int], stripe: int, expected: int
) -> tuple[int, mmap.mmap]:
    numel, num_counters, layout_hash = want
    _, size = _layout_sizes(numel, num_counters)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise _NameTaken(f"box {name!r}: {path} already exists (a box of that name is open?)") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask: owner only
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise UserError(f"no room in {SHM_DIR} for box {name!r} ({size >> 20} MiB): {e}") from None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        hdr = memoryview(mm)[:_PAGE].cast("q")
        hdr[_H_NUMEL], hdr[_H_NCOUNT], hdr[_H_LAYOUT] = numel, num_counters, layout_hash
        hdr[_H_STRIPE], hdr[_H_EXPECTED], hdr[_H_STATE] = stripe, expected, _READY
        hdr[_H_ATTACH0] = 1
        hdr[_H_MAGIC] = _MAGIC  # last: attachers wait for it
        hdr.release()
        return fd, mm
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
        raise


def _missing(hdr: memoryview, board: WorkerBoard | None) -> list[int]:
    """Local ranks that have not attached yet and still may: not known dead or exited (the launcher's
    board), nor ranks that join the run once it is under way (``workers = "MIN:MAX"``, one node: they
    attach by the name, which the launcher keeps, as replacements do)."""
    expected = hdr[_H_EXPECTED] if board is None else joins_from(hdr[_H_EXPECTED])
    return [
        r
        for r in range(1, expected)
        if not hdr[_H_ATTACH0 + r] and not (board is not None and board.state(r) != RUNNING)
    ]


def _finish_rendezvous(box: ShmBox, path: str, timeout: float, board: WorkerBoard | None) -> None:
    """Creator: wait for every local process to attach (or to be declared dead by the launcher: no
    need to wait the whole timeout for it), then unlink the name (the mapping stays)."""
    hdr = box._hdr

    def settled():
        return hdr[_H_REJECTED] or not _missing(hdr, board)

    try:
        wait_until(
            settled,
            timeout,
            lambda: (
                f"box {box.name!r}: local ranks {_missing(hdr, board)} did not attach to {path} "
                f"within {timeout:.0f} s"
            ),
        )
    except BaseException:
        hdr[_H_STATE] = _FAILED
        _unlink_quietly(path)
        box.close()
        raise
    if board is None:
        _unlink_quietly(path)
    # Under parambox's launcher the name stays until the run ends (the launcher removes the run's
    # segments then, or its reaper if it is SIGKILLed): a replacement attaches by it, also when no
    # live process holds the box any more (a rank 0 that dies just after the rendezvous, the others
    # finishing at once: its replacement must find this box, not make a new, empty one).
    if hdr[_H_REJECTED]:
        hdr[_H_STATE] = _FAILED
        error = UserError(f"box {box.name!r} ({_describe(hdr)}): a local process asked for a different one")
        box.close()
        raise error
    hdr[_H_STATE] = _OPEN


def _await_open(box: ShmBox, path: str, timeout: float, board: WorkerBoard | None) -> None:
    """An attacher: wait until the creator has seen everyone (or gave up)."""
    hdr = box._hdr

    def state() -> int:
        if hdr[_H_STATE] in (_OPEN, _FAILED):
            return hdr[_H_STATE]
        if board is not None and board.dead(0):
            raise CommTimeout(f"box {box.name!r}: local rank 0 died before it finished setting up {path}")
        return 0

    got = wait_until(
        state,
        timeout + 2.0,  # local rank 0 times out first and says why
        lambda: f"box {box.name!r}: local rank 0 did not finish the rendezvous on {path} (did it die?)",
    )
    if got == _FAILED:
        if hdr[_H_REJECTED]:
            raise UserError(
                f"box {box.name!r} ({_describe(hdr)}): another local process asked for a different one"
            )
        raise CommTimeout(f"box {box.name!r}: local rank 0 gave up waiting for the other local processes")


def _describe(hdr: memoryview) -> str:
    return f"numel={hdr[_H_NUMEL]}, num_counters={hdr[_H_NCOUNT]}, layout={hdr[_H_LAYOUT]:#x}"


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _open_by_name(name: str, path: str, timeout: float, board: WorkerBoard | None) -> int:
    def try_open():
        if board is not None and board.dead(0):
            raise CommTimeout(f"box {name!r}: local rank 0 died before it created {path}")
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None

    return wait_until(
        try_open,
        timeout,
        lambda: (
            f"box {name!r}: {path} does not exist (local rank 0 did not create it within "
            f"{timeout:.0f} s, or every process had already attached)"
        ),
    )


def _attach(
    name: str, path: str, fd: int, want: tuple[int, int, int], local_rank: int, timeout: float
) -> tuple[int, mmap.mmap]:
    """Map the segment behind ``fd`` after checking its header; flags this local rank as attached."""
    try:
        wait_until(
            lambda: os.fstat(fd).st_size >= _PAGE,
            timeout,
            lambda: f"box {name!r}: {path} stayed empty (did local rank 0 die while creating it?)",
        )
        head = mmap.mmap(fd, _PAGE, flags=mmap.MAP_SHARED)
        hdr = memoryview(head).cast("q")
        wait_until(
            lambda: hdr[_H_MAGIC] == _MAGIC,
            timeout,
            lambda: f"box {name!r}: {path} has no box header (did local rank 0 die while creating it?)",
        )
        have = (hdr[_H_NUMEL], hdr[_H_NCOUNT], hdr[_H_LAYOUT])
        with _lock(fd, _LOCK_META, timeout, lambda: f"box {name!r} attach"):
            if have != want:
                hdr[_H_REJECTED] += 1
            elif local_rank > 0 and not hdr[_H_ATTACH0 + local_rank]:
                hdr[_H_ATTACHED] += 1
                hdr[_H_ATTACH0 + local_rank] = 1
        hdr.release()
        head.close()
        if have != want:
            raise UserError(
                f"box {name!r} holds numel={have[0]}, num_counters={have[1]}, layout={have[2]:#x}; "
                f"this process asked for numel={want[0]}, num_counters={want[1]}, layout={want[2]:#x}"
            )
        _, size = _layout_sizes(want[0], want[1])
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _lock(fd: int, offset: int, timeout: float, what: Callable[[], str]):
    """The byte-range lock at ``offset``, waited for at most ``timeout`` s. A dead holder's lock goes with
    it; a stopped (SIGSTOP) or stalled one keeps it, so a blocking ``lockf`` would wait for good."""
    if not _try_lock(fd, offset):
        wait_until(
            lambda: _try_lock(fd, offset),
            timeout,
            lambda: f"{what()}: a lock stayed held for {timeout:g} s (its holder is stopped or stalled)",
        )
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def _try_lock(fd: int, offset: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: another process holds it
        return False
    return True
