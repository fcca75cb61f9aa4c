"""Temporary folders that are removed even when everything that made them was killed.

A folder made here (``make``, or ``folder`` as a ``with`` block) holds a marker file and is locked
(``flock`` on the folder) while its maker, or a process it handed the lock to, lives: the reaper of
an MPI job, a rank's forked data loaders. Its maker removes it on the way out; a reaper removes it
when its maker was SIGKILLed. Where both were killed (a container or a batch job stopped at once,
an OOM kill of the whole tree), the next parambox process that makes a folder of the same kind
removes every folder of that kind whose lock nobody holds (``sweep``). Only folders with the marker
are ever swept: a job script's own ``pb_mpi.*`` folder on a SLURM node is left alone.

>>> with folder("parambox-doc-") as path:
...     os.path.isdir(path)
True
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

BENCH = "parambox-bench-"  # the benchmarks' folders (their workers' outputs)
# Made once the folder is locked: a folder without it may be one whose maker has not locked it yet.
MARKER = ".parambox-scratch"


def make(prefix: str, root: str | None = None) -> tuple[str, int]:
    """A new folder ``<root>/<prefix>XXXXXXXX`` (root: the temporary directory) and the descriptor that
    holds its lock; abandoned folders of the same prefix are swept first. A forked child shares the
    lock; give the descriptor to a spawned process with ``pass_fds``."""
    sweep(prefix, root)
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a file system without locks: no marker, so never swept (its maker removes it)
        return path, fd
    with open(os.path.join(path, MARKER), "w"):
        pass
    return path, fd


def remove(path: str, fd: int) -> None:
    """Remove a folder from ``make`` and drop its lock."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(fd)


@contextlib.contextmanager
def folder(prefix: str, root: str | None = None) -> Iterator[str]:
    """``make`` for the length of a ``with`` block: the folder is removed when it ends."""
    path, fd = make(prefix, root)
    try:
        yield path
    finally:
        remove(path, fd)


def sweep(prefix: str, root: str | None = None) -> list[str]:
    """Remove the folders ``<root>/<prefix>*`` that carry the marker and whose lock nobody holds;
    returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if not name.startswith(prefix) or not os.path.exists(os.path.join(path, MARKER)):
                continue
            if remove_if_unlocked(path):
                removed.append(path)
    return removed


def remove_if_unlocked(path: str) -> bool:
    """Remove ``path`` if nobody holds its lock; whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # someone holds it
        os.close(fd)
        return False
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)
    return True
