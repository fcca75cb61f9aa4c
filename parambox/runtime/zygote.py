"""Warm starts: parambox's Python processes forked from one that has already imported torch.

``import torch`` costs 2-3 s of CPU, longer than a short run, and every worker paid it: a sweep,
``pick``, a study or the test suite starts hundreds. The first launch in a process starts a
*zygote* (``python -m parambox.runtime.zygote``, which dies with this process): it imports torch,
numpy, pydantic, rich and psutil once (never parambox itself, whose modules read the environment,
nor mpi4py's ``MPI``, whose import initialises MPI) and then forks each process it is asked for.
The child takes the environment, working directory, standard streams and descriptors sent with the
request, leads a session of its own, and runs ``python -m MODULE ARGS`` as a fresh interpreter
would (``runpy``; the exit code, tracebacks, ``atexit`` and thread joins alike). A child dies when
the connection that asked for it closes, also when its requester is SIGKILLed: the zygote then
kills the child's session, as ``PR_SET_PDEATHSIG`` does for a direct child.

>>> proc = start("parambox.run.worker", [run_dir], env)  # doctest: +SKIP
>>> proc.wait()                                             # doctest: +SKIP

:class:`Forked` answers like ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``returncode``,
``stdin``/``stdout``/``stderr`` pipes, signals). A process that starts others (``pick``, studies)
hands its zygote to them through ``PARAMBOX_ZYGOTE`` (:func:`shared_env`). ``PARAMBOX_ZYGOTE=0``
turns warm starts off: every process is then a fresh interpreter, as before. Linux only (elsewhere
always fresh).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

ENV = "PARAMBOX_ZYGOTE"  # a zygote's socket name, to use it; "0": no warm starts
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "numpy", "pydantic", "rich", "psutil")
# parambox's own modules a worker or a launcher imports; a child whose sys.path finds another
# parambox imports its own instead.
PRELOAD_OWN = ("parambox.cli", "parambox.run.worker", "parambox.training.loop", "parambox.workload")
_MAX_REQUEST = 1 << 20
# Hooks of the preloaded modules, which the zygote knows by no name: run once in the zygote after the
# preload (to import more, e.g. every registered strategy), and in each child once its environment is
# the request's (a registry read from the environment at import reads it again).
_WARM: list[Callable[[], None]] = []
_IN_CHILD: list[Callable[[], None]] = []


def when_warming(hook: Callable[[], None]) -> None:
    """Run ``hook`` in the zygote after its preload; its errors are ignored (a cold import then)."""
    _WARM.append(hook)


def in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in each forked child once the request's environment is set, before its module runs."""
    _IN_CHILD.append(hook)


# -- the client: this process's zygote, and the processes it forks ---------------------------------


class Forked:
    """A process forked by the zygote, answering like ``subprocess.Popen``. Its exit status arrives
    on a pipe the zygote writes when it reaps the process."""

    def __init__(self, args: list[str], pid: int, status_fd: int, streams: dict[str, Any]):
        self.args, self.pid, self.returncode = args, pid, None
        self._status = status_fd
        self.stdin, self.stdout, self.stderr = (
            streams.get("stdin"),
            streams.get("stdout"),
            streams.get("stderr"),
        )

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode  # type: ignore[return-value]

    def _collect(self) -> None:
        data = b""
        while chunk := os.read(self._status, 64):
            data += chunk
        os.close(self._status)
        # No status: the zygote died, and with it (PR_SET_PDEATHSIG) this process.
        self.returncode = int(data) if data.strip() else -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.close(self._status)


class _Client:
    """One connection to a zygote (ours, or the one ``PARAMBOX_ZYGOTE`` names)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.name = ""
        self.process: subprocess.Popen | None = None  # when it is this process's own

    def connected(self) -> socket.socket | None:
        if self.sock is not None and (self.process is None or self.process.poll() is None):
            return self.sock
        if self.sock is None and self.process is not None and self.process.poll() is None:
            return self._connect(self.name)  # started ahead (prestart)
        self.close()
        name = os.environ.get(ENV, "")
        if name and name != "0":
            with contextlib.suppress(OSError):
                return self._connect(name)
        return self._connect(self._start())

    def _start(self) -> str:
        from parambox.runtime import spawn

        name = f"parambox-zygote-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind("\0" + name)  # abstract: nothing on disk to leave behind
        listener.listen(64)
        try:
            # One OpenMP thread while it imports: with more, torch's import starts libgomp's pool,
            # and a forked child's first parallel region would hang (libgomp is not fork-safe).
            env = {k: v for k, v in os.environ.items() if k != ENV} | {"OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "parambox.runtime.zygote", str(listener.fileno())]
            self.process = subprocess.Popen(  # not spawn.start, which would ask the zygote
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=[listener.fileno()],
                start_new_session=True,
                preexec_fn=spawn._die_with_parent,
            )
        finally:
            listener.close()
        self.name = name
        return name

    def _connect(self, name: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + name)
        except OSError:
            sock.close()
            raise
        self.sock, self.name = sock, name
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.name = None, ""
        if self.process is not None:
            from parambox.runtime import spawn

            spawn.stop([self.process], grace_s=0.5)
            self.process = None


_CLIENT = _Client()


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(ENV) != "0"


def can_start(cmd: Sequence[str], popen: dict[str, Any]) -> bool:
    """Whether ``spawn.start(cmd, **popen)`` can be a warm start: ``python -m MODULE ...`` with no
    more than standard streams and descriptors to hand over."""
    return (
        enabled()
        and len(cmd) >= 3
        and cmd[0] == sys.executable
        and cmd[1] == "-m"
        and set(popen) <= {"stdin", "stdout", "stderr", "pass_fds"}
        and all(
            popen.get(k) in (None, subprocess.PIPE, subprocess.DEVNULL) or _fd(popen[k]) >= 0
            for k in ("stdin", "stdout")
        )
        and (
            popen.get("stderr") in (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT)
            or _fd(popen["stderr"]) >= 0
        )
    )


def start(module: str, args: Sequence[str], env: dict[str, str], **popen: Any) -> Forked | None:
    """``python -m module args`` forked by the zygote (started here on first use); None when there
    is no zygote to be had (the caller then starts a fresh interpreter)."""
    with _CLIENT.lock:
        try:
            sock = _CLIENT.connected()
            return _request(sock, module, list(args), env, popen)
        except OSError:
            _CLIENT.close()
            return None


def prestart() -> None:
    """Start this process's zygote now, without waiting for it: its torch import then overlaps the
    caller's own start-up (``parambox train`` calls this before it imports torch itself)."""
    if not enabled() or os.environ.get(ENV):
        return
    with _CLIENT.lock, contextlib.suppress(OSError):
        if _CLIENT.sock is None and _CLIENT.process is None:
            _CLIENT._start()


def pid() -> int | None:
    """This process's own zygote, if it started one (a test's orphan killer must spare it)."""
    p = _CLIENT.process
    return p.pid if p is not None and p.poll() is None else None


def shared_env() -> dict[str, str]:
    """``{PARAMBOX_ZYGOTE: name}`` for the processes this one starts, so that their workers fork
    from this process's zygote too (started here if there is none); ``{}`` where warm starts are off."""
    if not enabled():
        return {}
    with _CLIENT.lock:
        try:
            _CLIENT.connected()
        except OSError:
            _CLIENT.close()
            return {}
        return {ENV: _CLIENT.name}


def _fd(target: Any) -> int:
    if isinstance(target, int) and target >= 0:
        return target
    try:
        return target.fileno()
    except (AttributeError, OSError, ValueError):
        return -1


def _request(sock: socket.socket, module: str, args: list[str], env: dict[str, str], popen: dict) -> Forked:
    """Send the request with the child's descriptors; the parent's ends of any pipes become the
    ``Forked``'s streams."""
    targets: list[int] = []
    send: list[int] = []
    close_after: list[int] = []
    streams: dict[str, Any] = {}
    devnull = None
    for target, key in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        what = popen.get(key)
        if what is None:
            fd = target  # inherit ours
        elif what == subprocess.STDOUT:
            fd = send[targets.index(1)] if 1 in targets else 1
        elif what == subprocess.DEVNULL:
            devnull = devnull if devnull is not None else os.open(os.devnull, os.O_RDWR)
            fd = devnull
        elif what == subprocess.PIPE:
            r, w = os.pipe()
            ours, theirs = (w, r) if target == 0 else (r, w)
            streams[key] = os.fdopen(ours, "wb" if target == 0 else "rb")
            close_after.append(theirs)
            fd = theirs
        else:
            fd = _fd(what)
        targets.append(target)
        send.append(fd)
    for fd in popen.get("pass_fds") or ():
        targets.append(fd)
        send.append(fd)
    status_r, status_w = os.pipe()
    close_after.append(status_w)
    if devnull is not None:
        close_after.append(devnull)
    try:
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "fds": targets}
        data = json.dumps(request).encode()
        if len(data) > _MAX_REQUEST:
            raise OSError("request too large")
        socket.send_fds(sock, [data], [status_w, *send])
        reply = sock.recv(64)
        if not reply:
            raise OSError("the zygote closed the connection")
        (child,) = struct.unpack("i", reply)
    except BaseException:
        os.close(status_r)
        for s in streams.values():
            s.close()
        raise
    finally:
        for fd in close_after:
            os.close(fd)
    return Forked([sys.executable, "-m", module, *args], child, status_r, streams)


# -- the zygote ------------------------------------------------------------------------------------


def serve(listen_fd: int) -> dict[str, Any]:
    """The zygote's loop: accept connections, fork a child per request, report each child's exit
    status to its pipe, and kill a closed connection's children. Returns only in a child, with the
    request it is to run."""
    for name in PRELOAD + PRELOAD_OWN:
        with contextlib.suppress(Exception):
            __import__(name)
    with contextlib.suppress(Exception):
        # A torch optimizer's first add_param_group imports torch._dynamo (1.9 s here, no thread):
        # once here instead of in every child that builds an optimizer.
        import torch

        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for hook in _WARM:
        with contextlib.suppress(Exception):
            hook()
    listener = socket.socket(fileno=listen_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    owners: dict[socket.socket, set[int]] = {}
    status: dict[int, tuple[int, socket.socket]] = {}  # child pid -> its status pipe, its connection
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != os.getuid():
                    conn.close()
                    continue
                owners[conn] = set()
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "reap":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(status, owners)
            else:
                conn = key.fileobj
                try:
                    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 256)
                except OSError:
                    data, fds = b"", []
                if not data:  # the requester is gone: so are its children
                    sel.unregister(conn)
                    for child in owners.pop(conn):
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(child, signal.SIGKILL)
                    conn.close()
                    continue
                request = json.loads(data)
                child = os.fork()
                if child == 0:  # the zygote's own descriptors closed through their objects
                    request["received"] = fds
                    sel.close()
                    for sock in (listener, *owners):
                        sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                for fd in fds[1:]:
                    os.close(fd)
                status[child] = (fds[0], conn)
                owners[conn].add(child)
                conn.send(struct.pack("i", child))


def _reap(status: dict[int, tuple[int, socket.socket]], owners: dict[socket.socket, set[int]]) -> None:
    while True:
        try:
            child, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if child == 0:
            return
        fd, conn = status.pop(child, (-1, None))
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.write(fd, str(os.waitstatus_to_exitcode(code)).encode())
            os.close(fd)
        owners.get(conn, set()).discard(child)


def become(request: dict[str, Any]) -> None:
    """In the child: its session, its death with the zygote, its descriptors, environment, working
    directory and ``sys.path`` (as ``python -m`` from there would have them); then run the module."""
    from parambox.runtime import spawn  # preloaded

    os.setsid()
    spawn._die_with_parent()  # with the zygote
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    received, targets = request["received"], request["fds"]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in received[1:]]
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in high:
            with contextlib.suppress(OSError):
                os.close(fd)
    for target, fd in zip(targets, high):
        os.dup2(fd, target)
    for fd in high:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again, as a fresh interpreter would
    if os.environ.get("PYTHONFAULTHANDLER"):  # as a fresh interpreter reads it at start
        import faulthandler

        faulthandler.enable()
    _threads_as_fresh()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # as a fresh interpreter sets its streams up
    sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)
    os.chdir(request["cwd"])
    own = {sys.path[0], *os.environ.get("PYTHONPATH_ZYGOTE", "").split(os.pathsep)}
    base = [p for p in sys.path if p not in own]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *base]
    _own_parambox_or_none()
    sys.modules.pop(request["module"], None)  # preloaded, it runs again as __main__ (runpy would warn)
    sys.argv = [request["module"], *request["args"]]
    import runpy

    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _threads_as_fresh() -> None:
    """torch's threads as a fresh interpreter would pick them: ``OMP_NUM_THREADS`` from the child's
    environment, else one per CPU it may run on (the zygote imported torch with one)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        given = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(
            int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))
        )


def _own_parambox_or_none() -> None:
    """Keep the preloaded parambox where the child's ``sys.path`` finds the same one (its hooks run
    for the child's environment); else drop it, for the child to import its own."""
    loaded = sys.modules.get("parambox")
    spec = next(
        filter(None, (f.find_spec("parambox", None) for f in sys.meta_path if hasattr(f, "find_spec"))), None
    )
    same = loaded is not None and spec is not None and spec.origin == getattr(loaded, "__file__", None)
    if same:
        for hook in _IN_CHILD:
            hook()
        return
    _IN_CHILD.clear()  # the hooks of the modules dropped here
    for name in [m for m in sys.modules if m == "parambox" or m.startswith("parambox.")]:
        del sys.modules[name]


if __name__ == "__main__":
    # one module for this file: the preloaded modules register their hooks with `parambox.runtime.zygote`
    sys.modules.setdefault("parambox.runtime.zygote", sys.modules[__name__])
    os.environ["PYTHONPATH_ZYGOTE"] = os.environ.get("PYTHONPATH", "")
    become(serve(int(sys.argv[1])))
