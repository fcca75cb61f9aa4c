"""How parambox tells a user about problems: errors they caused (the CLI prints them as one line and
exits with code 2), timeouts that name the peer or phase, and one-line warnings."""

from __future__ import annotations

import sys


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


class CommTimeout(RuntimeError):
    """A blocking wait ran past its timeout; the message names the phase and the missing peers."""


def warn(text: str) -> None:
    """A problem the run carries on with: one line on stderr, ``parambox: warning: ...``."""
    print(f"parambox: warning: {text}", file=sys.stderr, flush=True)


def validation_message(e) -> str:
    """A pydantic ``ValidationError`` as one line naming each bad field."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"config field {loc!r}: {err['msg']}")
    return "; ".join(parts)
