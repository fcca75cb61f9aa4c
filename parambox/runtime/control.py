"""The local launcher's board of its workers, and the descriptors it hands to a replacement.

The launcher knows at once when a worker dies (it is the parent); the workers do not. The board
tells them: an anonymous shared-memory file (``memfd_create``: it has no name, so nothing appears in
/dev/shm, and it is gone with the last process that maps it) of int64 slots that the launcher
writes and every worker maps read-only through the descriptor it inherits (``PARAMBOX_BOARD_FD``).
Per rank: its ``state`` (running, exited, or dead for good: no replacement is coming) and its
``life`` (0 for the first process of that rank, +1 for each replacement). Aligned 8-byte loads and
stores are atomic, so nobody locks: a worker reads a slot whenever it waits for a peer (the box
rendezvous, an asynchronous run's wait for rank 0's center, rank 0's wait for the others at the end)
and stops waiting for a rank the launcher has declared dead.

A replacement worker also inherits the shared-memory boxes of the run: the launcher keeps a
descriptor of each segment (opened through ``/proc/<worker pid>/fd/<n>`` once a worker has it
open) and passes them with ``pass_fds``, named in ``PARAMBOX_BOX_FDS``; the segment's name also
stays in /dev/shm while the run lasts, for a replacement that comes before the launcher took a
descriptor. The launcher's descriptors die with it, and its reaper removes the names, so even a
SIGKILLed launcher leaves nothing behind: its workers die with it (``PR_SET_PDEATHSIG``), and the
memory goes with the last descriptor.

>>> board = WorkerBoard.create(3)          # the launcher
>>> board.set_state(2, DEAD); board.dead(2), board.dead(1)
(True, False)
>>> board.close()
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable, Mapping

BOARD_ENV = "PARAMBOX_BOARD_FD"  # the board's descriptor in a worker
LIFE_ENV = "PARAMBOX_LIFE"  # 0 in a worker's first life, k in its k-th replacement (or group restart)
BOX_FDS_ENV = "PARAMBOX_BOX_FDS"  # "name:fd,..." shared-memory boxes a replacement attaches to
BOX_OWNER_ENV = "PARAMBOX_BOX_OWNER"  # the pid holding those descriptors (the launcher)
REJOIN_ENV = "PARAMBOX_REJOIN"  # "1" in a replacement that joins a run in progress
SPARE_FLAG = "--spare"  # the worker entry waits, warmed up, to be told which dead rank it replaces
SPARE_ENV = "PARAMBOX_FROM_SPARE"  # "1" in a replacement that was a warm spare

RUNNING, DEAD, EXITED = 0, 1, 2
_MAGIC = int.from_bytes(b"PBXBOARD", "little")
_HEAD = 4  # magic, world size, restarts so far, spare
_PER_RANK = 2  # state, life


class WorkerBoard:
    """Who of the run's ranks is running, exited or dead for good, and in which life (see the module)."""

    def __init__(self, fd: int, world_size: int, writable: bool):
        self.fd, self.world_size = fd, world_size
        size = 8 * (_HEAD + _PER_RANK * world_size)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self._slots = memoryview(self._mm).cast("q")

    @classmethod
    def create(cls, world_size: int) -> WorkerBoard:
        fd = os.memfd_create("parambox-board")  # close-on-exec: children get it through pass_fds only
        os.ftruncate(fd, 8 * (_HEAD + _PER_RANK * world_size))
        board = cls(fd, world_size, writable=True)
        board._slots[1] = world_size
        board._slots[0] = _MAGIC
        return board

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerBoard | None:
        """This worker's view of its launcher's board; None when no parambox launcher started it."""
        env = os.environ if env is None else env
        text = env.get(BOARD_ENV, "")
        if not text:
            return None
        key = int(text)
        if key not in _OPEN:
            n = (os.fstat(key).st_size // 8 - _HEAD) // _PER_RANK  # the size tells the world size
            _OPEN[key] = cls(key, n, writable=False)
        return _OPEN[key]

    # -- reading (workers and launcher) -------------------------------------------------------------
    def state(self, rank: int) -> int:
        return self._slots[_HEAD + _PER_RANK * rank]

    def life(self, rank: int) -> int:
        return self._slots[_HEAD + _PER_RANK * rank + 1]

    def dead(self, rank: int) -> bool:
        """The launcher saw ``rank`` die and will not replace it."""
        return 0 <= rank < self.world_size and self.state(rank) == DEAD

    def dead_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if self.state(r) == DEAD]

    @property
    def restarts(self) -> int:
        return self._slots[2]

    # -- writing (the launcher) ---------------------------------------------------------------------
    def set_state(self, rank: int, state: int) -> None:
        self._slots[_HEAD + _PER_RANK * rank] = state

    def begin_life(self, rank: int) -> int:
        """A replacement of ``rank`` starts: its life number goes up (peers waiting on it see progress)."""
        life = self.life(rank) + 1
        self._slots[_HEAD + _PER_RANK * rank + 1] = life
        self._slots[_HEAD + _PER_RANK * rank] = RUNNING
        self._slots[2] += 1
        return life

    def env(self) -> dict[str, str]:
        return {BOARD_ENV: str(self.fd)}

    def close(self) -> None:
        self._slots.release()
        self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


_OPEN: dict[int, WorkerBoard] = {}


def current_life(env: Mapping[str, str] | None = None) -> int:
    """0 in a worker's first life; k in its k-th replacement (fault injection fires in life 0 only)."""
    return int((os.environ if env is None else env).get(LIFE_ENV) or 0)


def rejoining(env: Mapping[str, str] | None = None) -> bool:
    """This process replaces a dead worker of a run that goes on (not a restart of the whole group)."""
    return (os.environ if env is None else env).get(REJOIN_ENV) == "1"


def reopen_box_fds(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the box descriptors it names (those of the launcher, ``PARAMBOX_BOX_OWNER``)
    opened in this process, through ``/proc/<owner>/fd``: how a spare, started before the boxes
    existed (and forked by the zygote: not the launcher's child), gets them."""
    owner = env.get(BOX_OWNER_ENV, str(os.getppid()))
    items = []
    for item in env.get(BOX_FDS_ENV, "").split(","):
        box, _, fd = item.rpartition(":")
        if box and fd.isdigit():
            items.append(f"{box}:{os.open(f'/proc/{owner}/fd/{fd}', os.O_RDWR)}")
    return {**env, SPARE_ENV: "1", **({BOX_FDS_ENV: ",".join(items)} if items else {})}


def inherited_box_fd(name: str, env: Mapping[str, str] | None = None) -> int | None:
    """The descriptor of shared-memory box ``name`` this replacement inherited from its launcher."""
    for item in (os.environ if env is None else env).get(BOX_FDS_ENV, "").split(","):
        box, _, fd = item.rpartition(":")
        if box == name and fd.isdigit():
            return int(fd)
    return None


class SegmentKeeper:
    """The launcher's own descriptors of the run's shared-memory boxes, for replacements.

    ``scan(pids)`` looks through the workers' open descriptors for segments named with the run's
    prefix (before or after their name is unlinked) and opens each once, through ``/proc``.
    """

    def __init__(self, prefix: str, root: str = "/dev/shm"):
        self.mark = f"{root}/{prefix}"
        self.fds: dict[str, int] = {}

    def scan(self, pids: Iterable[int]) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                for entry in os.listdir(f"/proc/{pid}/fd"):
                    self._take(pid, entry)

    def _take(self, pid: int, entry: str) -> None:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
            if not target.startswith(self.mark):
                return
            name = target[len(self.mark) :].removesuffix(" (deleted)")
            if name not in self.fds:
                self.fds[name] = os.open(f"/proc/{pid}/fd/{entry}", os.O_RDWR | os.O_CLOEXEC)

    def env(self) -> dict[str, str]:
        return {BOX_FDS_ENV: ",".join(f"{n}:{fd}" for n, fd in self.fds.items())} if self.fds else {}

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
