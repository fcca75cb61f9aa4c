"""MPI as parambox uses it: fault tolerance (ULFM), an end that survives dead ranks, nothing left behind.

Found by the prototype study of issue 13 (Open MPI 5.0 with ULFM, mpi4py 4):

- Under ``mpiexec --with-ft ulfm`` a SIGKILLed rank does not end the job; the survivors learn of it
  from ``Comm.Get_failed()`` (within ~2-30 ms at a rank that drives MPI's progress engine).
- The end of such a run: a fault-tolerant barrier (``Iagree``, acknowledging failures between
  tries), then ``Win.Free`` (a plain barrier fails at once at some ranks while others still work),
  then ``MPI_Finalize`` with a deadline: after a failure Open MPI's Finalize sometimes never returns,
  and mpi4py's ``MPI.Finalize()`` holds the GIL, so it is called through ctypes (which releases it)
  while a timer thread ends the process (an exit without Finalize is clean under ULFM).
- An Open MPI 5 singleton (a process that imports mpi4py with no ``mpiexec``: e.g. under ``srun``
  here, where PMIx cannot wire it up) leaves its 16 MiB ``/dev/shm/sm_segment.*`` file behind even
  after a clean Finalize; it needs no shared-memory transport at all (``btl=self``). ``srun`` of
  several tasks gives several singletons: that is detected before mpi4py is imported.

Nothing here imports mpi4py at module level (importing it initialises MPI).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from parambox.errors import CommTimeout

FT_ENV = "OMPI_MCA_mpi_ft_enable"  # set to 1 by mpiexec --with-ft ulfm in every rank's environment
_MPI_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD")
FINALIZE_DEADLINE_S = 5.0


def fault_tolerant(env: Mapping[str, str] | None = None) -> bool:
    """True under ``mpiexec --with-ft ulfm``: a dead rank does not end the job."""
    return (os.environ if env is None else env).get(FT_ENV, "").lower() in ("1", "true")


def launched_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(k in env for k in _MPI_LAUNCHED)


def srun_without_mpi(env: Mapping[str, str] | None = None) -> str | None:
    """The one-line reason, if ``srun`` started this process as one of several tasks that MPI cannot
    join into one job (each would be a singleton); None otherwise. Check before importing mpi4py."""
    env = os.environ if env is None else env
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 0)
    if tasks > 1 and "SLURM_PROCID" in env and not launched_by_mpi(env):
        return (
            f"srun started {tasks} tasks, but this Open MPI cannot join srun's tasks into one MPI job "
            f"(each would run alone); for --box rma use `parambox slurm ... -- --box rma`, a batch "
            f"script that starts the ranks with mpiexec --with-ft ulfm inside the allocation"
        )
    return None


# Set beside OMPI_MCA_btl=self where before_import chose it: an mpiexec this process starts later drops
# both (spawn.mpi_env), or its ranks, which do need a transport, inherit "self" and cannot start.
ALONE_ENV = "PARAMBOX_MPI_ALONE"


def before_import(env: dict[str, str] | None = None) -> None:
    """Call before the first ``import mpi4py.MPI``: a process that no MPI launcher started runs alone,
    and then needs no shared-memory transport (which would leave a 16 MiB file in /dev/shm); the
    session directory it makes is removed when it exits (``_singleton_dirs``)."""
    own = env is None
    env = os.environ if env is None else env
    if launched_by_mpi(env):
        return
    if "OMPI_MCA_btl" not in env:
        env["OMPI_MCA_btl"], env[ALONE_ENV] = "self", "1"
    if own:
        before = _singleton_dirs()
        # registered before mpi4py's own exit hook, so it runs after MPI_Finalize (hooks run last first)
        atexit.register(_remove_new_dirs, before)


def _singleton_dirs() -> set[Path]:
    """Open MPI 5's per-job session directories of this user (``<tmp>/ompi.<host>.<uid>/jf.<n>/<job>``):
    a singleton's Finalize empties its own and leaves it, one more empty directory each run."""
    base = os.environ.get("TMPDIR") or os.environ.get("TEMP") or os.environ.get("TMP") or "/tmp"
    return set(Path(base).glob(f"ompi.*.{os.getuid()}/jf.*/*"))


def _remove_new_dirs(before: set[Path]) -> None:
    """At exit: ``MPI_Finalize`` (mpi4py's own comes later, after every Python exit hook, and then
    finds it done), then remove the session directories made since ``before`` that are empty now (this
    process's; a live job's holds its files, and ``rmdir`` leaves a directory that is not empty)."""
    finalize_with_deadline(1)
    for d in _singleton_dirs() - before:
        with contextlib.suppress(OSError):
            d.rmdir()


def for_children(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process this one starts, without the transport ``before_import`` chose for this
    process alone (an MPI job of one): an ``mpiexec`` started with it could not connect its ranks.

    >>> for_children({"OMPI_MCA_btl": "self", ALONE_ENV: "1", "X": "1"})
    {'X': '1'}
    """
    out = dict(env)
    if out.pop(ALONE_ENV, None) and out.get("OMPI_MCA_btl") == "self":
        del out["OMPI_MCA_btl"]
    return out


def failed_ranks(comm) -> list[int]:
    """Ranks of ``comm`` known dead (empty unless fault tolerant). Drives MPI's progress engine first:
    a rank that only does one-sided operations on shared memory would otherwise never hear of it."""
    from mpi4py import MPI

    try:
        comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    except MPI.Exception as e:  # a receive from any source reports unacknowledged failures
        if e.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
            raise
        comm.Ack_failed()
    group = comm.Get_failed()
    try:
        n = group.Get_size()
        return sorted(MPI.Group.Translate_ranks(group, list(range(n)), comm.Get_group())) if n else []
    finally:
        group.Free()


def ft_barrier(comm, timeout: float, what: str) -> None:
    """A barrier of the ranks still alive (``Iagree``): a failure makes it raise at every survivor
    alike until acknowledged, so acknowledge and agree again. ``CommTimeout`` after ``timeout`` s."""
    import numpy as np
    from mpi4py import MPI

    deadline = time.monotonic() + timeout
    while True:
        flag = np.ones(1, dtype=np.int32)
        req = comm.Iagree(flag)
        try:
            await_request(
                req, deadline, lambda: f"{what}: not every live rank arrived within {timeout:.0f} s"
            )
            return
        except MPI.Exception as e:
            if e.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
                raise
            comm.Ack_failed()


def await_request(req, deadline: float, what) -> None:
    """Poll a nonblocking MPI request until it completes; ``CommTimeout(what())`` past ``deadline``
    (``time.monotonic()``)."""
    while not req.Test():
        if time.monotonic() > deadline:
            raise CommTimeout(what())
        time.sleep(0.001)


def finalize_with_deadline(code: int, seconds: float = FINALIZE_DEADLINE_S) -> None:
    """``MPI_Finalize``, where this process initialised MPI and has not finalised it yet; if it has not
    returned after ``seconds``, end the process with ``code``."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return

    def bail() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, bail)
    timer.daemon = True
    timer.start()
    _libmpi().MPI_Finalize()  # through ctypes: the GIL is released, so the timer can run
    timer.cancel()


def finalize_at_exit() -> None:
    """After a rank of the job died (ULFM): this process's exit calls ``MPI_Finalize`` with a deadline
    (``finalize_with_deadline``), before mpi4py's own exit hook, which holds the GIL and sometimes never
    returns then. A user's script that got to its end then ends: 1 past the deadline where an uncaught
    exception ended it, else 0. Once a process; nothing without MPI."""
    global _FINALIZE_AT_EXIT
    if _FINALIZE_AT_EXIT or sys.modules.get("mpi4py.MPI") is None:
        return
    _FINALIZE_AT_EXIT = True
    atexit.register(lambda: finalize_with_deadline(1 if getattr(sys, "last_value", None) is not None else 0))


_FINALIZE_AT_EXIT = False


def exit_now(code: int) -> None:
    """End a worker without running C++ static destructors: gloo's helper threads sometimes abort
    there ("terminate called without an active exception") even after destroy_process_group().
    Everything worth keeping is already on disk (checkpoints fsynced, metrics closed)."""
    # mpiexec counts a rank that exits without Finalize as failed; after a rank's death under ULFM it
    # sometimes never returns, so it gets a deadline.
    finalize_with_deadline(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _libmpi() -> ctypes.CDLL:
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libmpi.so" in path:
                return ctypes.CDLL(path)
    raise RuntimeError("libmpi is not loaded")
