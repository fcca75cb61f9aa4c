"""How parambox tells a user about problems: errors they caused (the CLI prints them as one line and
exits with code 2), timeouts that name the peer or phase, and one-line warnings."""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input (config field, file, value): reported as one line, exit code 2, no traceback."""


class CommTimeout(RuntimeError):
    """A blocking wait ran past its timeout; the message names the phase and the missing peers."""


def warn(text: str) -> None:
    """A problem the run carries on with: one line on stderr, ``parambox: warning: ...``."""
    print(f"parambox: warning: {text}", file=sys.stderr, flush=True)
