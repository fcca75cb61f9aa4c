"""How parambox tells a user about problems: errors they caused (the CLI prints them as one line and
exits with code 2), timeouts that name the peer or phase, one-line warnings, SIGTERM as an
interrupt, and SIGUSR1 as a batch system's "checkpoint and stop: you will be requeued"."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class UserError(ValueError):
    """Bad input (config field, file, value, a user's function): one line, exit code 2 on the CLI, no
    traceback on screen. A ``ValueError``, so library callers may catch either.

    >>> import parambox
    >>> try:
    ...     parambox.train(model="lenet", steps=0)
    ... except parambox.UserError as e:
    ...     print(e)  # doctest: +ELLIPSIS
    config field 'steps': ...
    """


class RunFailed(RuntimeError):
    """A run that a benchmark or a measurement started failed (not the user's input): the CLI prints the
    message (the run, its last lines, where its log was kept if it was) without a traceback, exit 1."""


class CommTimeout(RuntimeError):
    """A blocking wait ran past its timeout; the message names the phase and the missing peers."""


class BoxLost(CommTimeout):
    """A rank that held part of the rma box died: what it held went with it. ``lost`` names the rank and
    the request that found it; the message adds what the run can do (``remedy``)."""

    def __init__(self, lost: str, remedy: str):
        super().__init__(f"{lost}. {remedy}")
        self.lost = lost


def warn(text: str) -> None:
    """A problem the run carries on with: one line on stderr, ``parambox: warning: ...``."""
    print(f"parambox: warning: {text}", file=sys.stderr, flush=True)


# Signals that end a command as Ctrl-C does: ``kill`` or a batch system's time limit, a closed terminal
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
# The signal a batch system sends before its time limit (``sbatch --signal=USR1@90``, as Lightning and
# submitit ask for): stop as after Ctrl-C, checkpoint saved, and exit with REQUEUE_EXIT
REQUEUE_SIGNAL = signal.SIGUSR1
REQUEUE_EXIT = 75  # sysexits' EX_TEMPFAIL ("try again later"): the batch script requeues the job on it


class Preempted(KeyboardInterrupt):
    """The run stopped on ``REQUEUE_SIGNAL``: it unwinds as after Ctrl-C (a training run leaves its
    checkpoint) and the command exits with ``REQUEUE_EXIT``, so a batch script knows to requeue it and
    resume. ``step``: where the run stopped (None: before its loop began)."""

    def __init__(self, step: int | None = None) -> None:
        super().__init__(step)
        self.step = step


# Set when REQUEUE_SIGNAL came while a rank was starting: its training loop stops at its first step
# boundary (with its peers, which heard it too) instead of the rank leaving them in their first collective
REQUEUE_REQUESTED = threading.Event()


@contextlib.contextmanager
def terminate_as_interrupt(defer_requeue: bool = False) -> Iterator[None]:
    """SIGTERM (``kill``, a batch system's time limit) or SIGHUP (the terminal closed) raises
    ``KeyboardInterrupt``, and SIGUSR1 ``Preempted``, so the code inside unwinds as after Ctrl-C: workers
    stopped (a training run checkpoints), temporary folders and emulated nodes removed. ``defer_requeue``
    (a rank of an external launcher's): SIGUSR1 sets ``REQUEUE_REQUESTED`` for the training loop instead.
    Only in the main thread (elsewhere signals are left to the caller)."""

    def interrupt(signum, frame):
        if signum != REQUEUE_SIGNAL:
            raise KeyboardInterrupt
        if not defer_requeue:
            raise Preempted
        REQUEUE_REQUESTED.set()

    try:
        previous = {sig: signal.signal(sig, interrupt) for sig in (*TERMINATING, REQUEUE_SIGNAL)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def validation_message(e, fields: list[str] | None = None, prefix: str = "") -> str:
    """A pydantic ``ValidationError`` as one line naming each bad field; a key that is no field (pydantic:
    "Extra inputs are not permitted") gets the ``fields`` there are and the closest one."""
    parts = []
    for err in e.errors():
        if not err["loc"] and err["type"] == "value_error":  # a rule across fields: its message names them
            msg, name = err["msg"].removeprefix("Value error, "), prefix.rstrip(".")
            parts.append(msg if not name or msg.startswith(name) else f"{name}: {msg}")
            continue
        loc = prefix + (".".join(str(p) for p in err["loc"]) or "config")
        if err["type"] == "extra_forbidden" and fields is not None:
            parts.append(f"config field {loc!r} does not exist{unknown_hint(str(err['loc'][-1]), fields)}")
        else:
            parts.append(f"config field {loc!r}: {err['msg']}")
    return "; ".join(parts)


def unknown_hint(key: str, fields: list[str]) -> str:
    """``"; did you mean 'tau'? (choose from alpha, rho, tau)"`` for a misspelt ``key``.

    >>> unknown_hint("taux", ["tau", "alpha"])
    "; did you mean 'tau'? (choose from alpha, tau)"
    """
    import difflib

    close = difflib.get_close_matches(key, fields, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ";"
    return f"{guess} (choose from {', '.join(sorted(fields))})"
