"""torch.distributed set-up for any launcher, and collectives whose timeouts name the phase and peers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta

import torch.distributed as dist

from parambox.errors import CommTimeout
from parambox.runtime.world import World


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_address(world: World) -> tuple[str, int]:
    """MASTER_ADDR/PORT for this world. torchrun and the local launcher set them; under srun they
    come from the first host of the node list (``World`` reads it); under mpiexec rank 0 picks its
    host name and a free port and broadcasts them over MPI."""
    if world.master_addr and world.master_port:
        return world.master_addr, world.master_port
    if world.launcher == "mpi":
        from mpi4py import MPI  # initialises MPI: only under mpiexec

        addr = None
        if world.rank == 0:
            host = os.environ.get("PARAMBOX_MASTER_ADDR") or socket.gethostname()
            addr = (host, int(os.environ.get("MASTER_PORT") or free_port("")))
        return MPI.COMM_WORLD.bcast(addr, root=0)
    return "127.0.0.1", free_port()


def init_distributed(world: World, timeout_s: float) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU); a no-op for one process."""
    if world.world_size == 1 or dist.is_initialized():
        return
    addr, port = rendezvous_address(world)
    try:
        dist.init_process_group(
            world.backend,
            init_method=f"tcp://{addr}:{port}",
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as e:
        raise CommTimeout(
            f"rendezvous at {addr}:{port} failed for rank {world.rank} of {world.world_size} "
            f"(not every rank arrived within {timeout_s:.0f} s?): {str(e).splitlines()[0]}"
        ) from None


def destroy_distributed() -> None:
    # Without this, gloo workers sometimes abort at exit ("terminate called without an active exception").
    global BOARD
    BOARD = None  # drop our reference to the store before the group goes
    if dist.is_initialized():
        with suppress(Exception):
            dist.destroy_process_group()


class ProgressBoard:
    """Each rank posts the step it has reached to the rendezvous store, once per step, so that a
    timed-out collective can say which ranks never arrived instead of only "timed out"."""

    def __init__(self) -> None:
        self.store = None
        self.step = -1
        if dist.is_initialized():
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                self.store = _get_default_store()
            except Exception:
                self.store = None

    def post(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            self.store.set(f"parambox/step/{dist.get_rank()}", str(step))

    def laggards(self) -> list[int]:
        """Ranks whose last posted step is behind ours (or who never posted)."""
        if self.store is None:
            return []
        behind = []
        for r in range(dist.get_world_size()):
            key = f"parambox/step/{r}"
            try:
                if not self.store.check([key]) or int(self.store.get(key)) < self.step:
                    behind.append(r)
            except Exception:
                behind.append(r)
        return behind


BOARD: ProgressBoard | None = None


@contextmanager
def collective(phase: str) -> Iterator[None]:
    """Wrap blocking communication: a timeout becomes a ``CommTimeout`` naming phase and missing ranks."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if "imeout" not in text and "imed out" not in text and "closed" not in text.lower():
            raise
        who = BOARD.laggards() if BOARD is not None else []
        missing = f"ranks not arrived: {who}" if who else "a peer closed the connection or stalled"
        step = BOARD.step if BOARD is not None else "?"
        raise CommTimeout(f"{phase} at step {step} timed out: {missing}") from None
