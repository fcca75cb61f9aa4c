"""A run directory's guards: the lock its run holds, and the trust rule for the code it names.

- A run directory is locked (``flock`` on ``.parambox.lock``) by the process that runs it, from the
  "already holds a run" check to its end: a second run on it is refused at once.
- A run directory that names code (config.json's ``module:function`` references) is code: resume,
  export and ``parambox.run.load_model`` import it only from a directory this user owns, or when the
  caller says to trust it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any

from parambox.errors import UserError


def check_trust(run_dir: Path, cfg: Any, allow: str | None, given: dict | None = None) -> list[str]:
    """The one trust rule for every path that imports code a run directory names (resume, export,
    ``load_model``): config.json's references (``module:function``, ``file.py:function``) are code,
    imported only from a directory, and a config.json, this user owns. ``allow``: how this caller
    says "trust it" (``--trust``, ``trust=True``), None if it cannot; ``given``: the fields whose
    functions the caller hands in itself (nothing of those is imported). The references that will be
    imported, for the caller to announce."""
    from parambox.workload import CALLABLE_FIELDS
    from parambox.workload.refs import IN_PROCESS, is_reference
    from parambox.workload.refs import resolve as resolve_reference

    named = {f: str(getattr(cfg, f) or "") for f in CALLABLE_FIELDS if f not in (given or {})}
    for f, v in named.items():
        if v.startswith(IN_PROCESS + ":"):  # nothing can be built without it: say so before importing
            resolve_reference(v, f)  # a UserError: a function of the process that started the run
    refs = [f"{f}={v}" for f, v in named.items() if is_reference(v)]
    if not refs or allow == "trusted":
        return refs
    for path in (run_dir, run_dir / "config.json"):
        owner = path.stat().st_uid
        if owner != os.geteuid():
            hint = f"pass {allow} to run it" if allow else "copy the directory to continue it as yours"
            raise UserError(
                f"{path} belongs to uid {owner}, not you, and {run_dir / 'config.json'} names code to "
                f"import ({', '.join(refs)}): {hint}"
            )
    return refs


LOCK_FILE = ".parambox.lock"  # in a run directory: locked (flock) by the process that runs it
_locks: dict[Path, int] = {}  # run directory -> the open lock file this process holds


def lock(run_dir: Path, out_flag: str = "--out OUT") -> None:
    """Lock ``run_dir`` for this process until :func:`unlock` (or its exit, however it ends): a
    second run on the same directory, started before the first wrote anything that says "a run is
    here", is refused at once instead of interleaving its metrics with the first's and replacing its
    result. The lock file holds the owner's pid, for the message. ``out_flag``: how the caller names
    the run directory (``--out OUT``, ``out=...``). An ``OSError`` where it cannot be written."""
    if run_dir in _locks:
        raise UserError(f"run directory {run_dir} is in use by this process's other run")
    path = run_dir / LOCK_FILE
    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(
                f"run directory {run_dir} is in use by another run (pid {owner}); wait for it to end, "
                f"or pass another {out_flag}"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its owner removed it between our open and our lock: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _locks[run_dir] = fd


def unlock(run_dir: Path) -> None:
    """Release the lock :func:`lock` took and remove its file (nothing if this process holds
    none): a finished run's directory holds what it held before."""
    run_dir = Path(run_dir).resolve()
    fd = _locks.pop(run_dir, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            (run_dir / LOCK_FILE).unlink()  # still locked: whoever opened it meanwhile retries
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
