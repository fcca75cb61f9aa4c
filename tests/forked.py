"""Multi-process numerics tests on forked ranks: a fresh ``python`` costs 2-4 s of interpreter and torch
start here, a fork a few milliseconds. Each rank runs ``target(rank, *args)`` in a copy of this process
(torch already imported) and hands its result back through a file or a queue it was given.

Fork is safe here because the parent has started no threads of its own yet that the children need:
a rank sets its own thread count, starts its own process group and ends it (``destroy_distributed``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable

from parambox.box import PREFIX_ENV, new_prefix


def fork_ranks(
    target: Callable[..., None],
    n: int,
    args: tuple = (),
    timeout: float = 60.0,
    wait: bool = True,
    shm_prefix: str | None = None,
) -> list[mp.Process]:
    """Start ``target(rank, *args)`` on ``n`` forked processes with ``shm_prefix`` (default: a fresh
    one) as the shm box prefix in their environment; with ``wait``, join them all within ``timeout``
    (overall) and kill any still alive."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(n)]
    old = os.environ.get(PREFIX_ENV)
    os.environ[PREFIX_ENV] = shm_prefix or new_prefix()  # copied at fork; the parent's is restored
    try:
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop(PREFIX_ENV)
        else:
            os.environ[PREFIX_ENV] = old
    if wait:
        join_or_kill(procs, timeout)
    return procs


def join_or_kill(procs: list[mp.Process], timeout: float) -> None:
    """Join every process within ``timeout`` seconds overall; kill (and reap) those still running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
