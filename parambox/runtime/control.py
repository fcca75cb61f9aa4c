"""The local launcher's board of its workers.

The launcher knows at once when a worker dies (it is the parent); the workers do not. The board
tells them: an anonymous shared-memory file (``memfd_create``: it has no name, so nothing appears in
/dev/shm, and it is gone with the last process that maps it) of int64 slots that the launcher
writes and every worker maps read-only through the descriptor it inherits (``PARAMBOX_BOARD_FD``).
Per rank: its ``state`` (running, exited, or dead for good: no replacement is coming) and its
``life`` (0 for the first process of that rank, +1 for each replacement). Aligned 8-byte loads and
stores are atomic, so nobody locks: a worker reads a slot whenever it waits for a peer (the box
rendezvous, an asynchronous run's wait for rank 0's center, rank 0's wait for the others at the end)
and stops waiting for a rank the launcher has declared dead.

A replacement worker attaches to the run's shared-memory boxes by name: under this launcher a
box's name stays in /dev/shm while the run lasts (``box/shm.py``), and the launcher removes the
run's segments when it ends, or its reaper when the launcher itself is SIGKILLed (its workers die
with it: ``PR_SET_PDEATHSIG``). Keeping descriptors of the segments instead (found by scanning the
workers' descriptors) would miss a box that every worker let go of between two scans, leaving its
replacement without it.

>>> board = WorkerBoard.create(3)          # the launcher
>>> board.set_state(2, DEAD); board.dead(2), board.dead(1)
(True, False)
>>> board.close()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from collections.abc import Mapping

BOARD_ENV = "PARAMBOX_BOARD_FD"  # the board's descriptor in a worker
LIFE_ENV = "PARAMBOX_LIFE"  # 0 in a worker's first life, k in its k-th replacement (or group restart)
REJOIN_ENV = "PARAMBOX_REJOIN"  # "1" in a replacement that joins a run in progress
JOIN_FROM_ENV = "PARAMBOX_JOIN_FROM"  # workers = "MIN:MAX": MIN; the ranks from it on join the running run
SPARE_FLAG = "--spare"  # the worker entry waits, warmed up, to be told which dead rank it replaces
SPARE_ENV = "PARAMBOX_FROM_SPARE"  # "1" in a replacement that was a warm spare
CONSOLE_ENV = "PARAMBOX_CONSOLE_FD"  # rank 0: the launcher's console, for Python's output (stderr is a pipe)
HEARTBEAT_ENV = "PARAMBOX_HEARTBEAT"  # the file rank 0 touches as it steps (runtime/dist.py)

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


def joins_from(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """The first rank that joins the run once it is under way (``workers = "MIN:MAX"``: MIN); the world
    size where every rank starts it."""
    return min(world_size, int((os.environ if env is None else env).get(JOIN_FROM_ENV) or world_size))


def take_console(env: Mapping[str, str] | None = None) -> None:
    """Rank 0 under the local launcher: Python's ``sys.stderr`` (warnings, the progress bar, its error
    line) writes straight to the launcher's console (``CONSOLE_ENV``, a terminal keeps its bar), while
    the descriptor 2 that C++ writes to is the launcher's pipe: a group restart then moves a dying
    life's C++ frames into its log, as it does the other ranks'."""
    fd = (os.environ if env is None else env).get(CONSOLE_ENV)
    if not fd:
        return
    with contextlib.suppress(AttributeError, OSError, ValueError):
        old = sys.stderr
        old.flush()
        # this process's stderr from now on, encoded as the one it replaces
        sys.stderr = open(int(fd), "w", buffering=1, encoding=old.encoding, errors=old.errors)  # noqa: SIM115


def rejoining(env: Mapping[str, str] | None = None) -> bool:
    """This process replaces a dead worker of a run that goes on (not a restart of the whole group)."""
    return (os.environ if env is None else env).get(REJOIN_ENV) == "1"
