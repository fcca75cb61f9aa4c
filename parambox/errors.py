"""Errors a user can cause: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input (config field, file, value): reported as one line, exit code 2, no traceback."""


class CommTimeout(RuntimeError):
    """A blocking wait ran past its timeout; the message names the phase and the missing peers."""
