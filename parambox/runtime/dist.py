"""torch.distributed set-up for any launcher, and collectives whose timeouts name the phase and peers."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from parambox.errors import CommTimeout, UserError
from parambox.runtime.control import HEARTBEAT_ENV
from parambox.runtime.elastic import ElasticGroup, destroy_default_group
from parambox.runtime.faults import FaultPlan
from parambox.runtime.spawn import free_port
from parambox.runtime.world import World

_STARTS = itertools.count()  # process groups this process has started
_ADDR_BYTES = 1024  # room for rank 0's "host:port"
STORE_ANSWER_S = 5.0  # how long a live store takes at most to answer the timeout path's questions
_ELASTIC: ElasticGroup | None = None  # this process's group when the run survives in place


def elastic_group() -> ElasticGroup | None:
    """The group that goes on without lost ranks (``on_failure = "shrink"``); None otherwise."""
    return _ELASTIC


def rendezvous_address(world: World, timeout_s: float = 300.0) -> tuple[str, int]:
    """MASTER_ADDR/PORT for this world. torchrun and the local launcher set them; under srun they
    come from the first host of the node list (``World`` reads it); under mpiexec rank 0 picks its
    host name and a free port and broadcasts them over MPI."""
    if world.master_addr and world.master_port:
        return world.master_addr, world.master_port
    if world.launcher == "mpi":
        from mpi4py import MPI  # initialises MPI: only under mpiexec

        # "host:port" in a fixed buffer: a nonblocking broadcast with a deadline, and no pickle.
        buf = bytearray(_ADDR_BYTES)
        if world.rank == 0:
            host = os.environ.get("PARAMBOX_MASTER_ADDR") or socket.gethostname()
            text = f"{host}:{int(os.environ.get('MASTER_PORT') or free_port(''))}".encode()
            buf[: len(text)] = text
        request = MPI.COMM_WORLD.Ibcast([buf, MPI.BYTE], root=0)
        deadline = time.monotonic() + timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"rank {world.rank}: rank 0 did not post the rendezvous address in {timeout_s:.0f} s"
                )
            time.sleep(0.001)
        host, port = bytes(buf).rstrip(b"\0").decode().rsplit(":", 1)
        return host, int(port)
    return "127.0.0.1", free_port()


def check_store(world_size: int, env: Mapping[str, str] | None = None) -> None:
    """A ``UserError`` for a restart of more than one worker over the store torch's agents share with
    their workers across restarts (its default): the last life's keys would mislead this life's
    rendezvous (torch issue 135712; seen here as a 30 s connect timeout per rank, then a failure, or a
    hang; a plain DDP script whose ranks arrive a second apart fails the same way)."""
    env = os.environ if env is None else env
    if world_size > 1 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UserError(
            "torchrun restarted this worker, but its agents share one store across restarts, whose keys "
            "from the last life would mislead this one (torch issue 135712): set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"
        )


def init_distributed(
    world: World, timeout_s: float, survive_in_place: bool = False, defer_rejoin: bool = False
) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU); a no-op for one process. In a run
    that survives in place (the local launcher names its store; or ``survive_in_place`` under
    ``mpiexec --with-ft ulfm``), generation 0 of an ``ElasticGroup``. ``defer_rejoin``: a replacement
    in such a run asks to be admitted only at :func:`finish_rejoin`, once it is ready to train (the
    members stall from its admission until it has received their state)."""
    global _ELASTIC
    if world.world_size == 1 or dist.is_initialized():
        return
    if FaultPlan.from_env().kills_at_join(world.rank):
        os.kill(os.getpid(), signal.SIGKILL)  # dead before any peer heard of it
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)  # nccl's barriers and object collectives use the current GPU
    group = ElasticGroup.from_env(world.rank, world.world_size, timeout_s, world.backend)
    if group is None and survive_in_place and world.launcher == "mpi":
        from parambox.runtime.mpi import fault_tolerant

        if fault_tolerant():
            group = ElasticGroup.under_mpi(world, timeout_s)
    if group is not None:
        _ELASTIC = group
        if not (defer_rejoin and group.joins_late):
            group.join()
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        check_store(world.world_size)  # (one line now, not a timeout in the rendezvous below)
    addr, port = rendezvous_address(world, timeout_s)
    timeout = timedelta(seconds=timeout_s)
    try:
        store = rendezvous_store(world, addr, port, timeout)
        # A process may start a group again after destroying one (DistributedOptimizer after
        # DistributedOptimizer); under torchrun the store is the agent's, the same for every start,
        # so each start keeps its keys under a prefix of its own (else the old addresses are read).
        store = dist.PrefixStore(f"parambox/{next(_STARTS)}", store)
        dist.init_process_group(
            world.backend, store=store, rank=world.rank, world_size=world.world_size, timeout=timeout
        )
    except (RuntimeError, ValueError) as e:
        raise CommTimeout(
            f"rendezvous at {addr}:{port} failed for rank {world.rank} of {world.world_size} "
            f"(not every rank arrived within {timeout_s:.0f} s?): {str(e).splitlines()[0]}"
        ) from None


def finish_rejoin() -> None:
    """A replacement's admission, deferred by ``init_distributed(defer_rejoin=True)``: asks to join
    and waits to be admitted at a step boundary (a no-op anywhere else)."""
    if _ELASTIC is not None and _ELASTIC.joins_late and not dist.is_initialized():
        _ELASTIC.join()


_SERVERS: dict[tuple[str, int], dist.TCPStore] = {}  # this process's store servers, by address


def rendezvous_store(world: World, addr: str, port: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store: torchrun's agent's where it offers one, else rank 0 serves it on ``addr``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return next(dist.rendezvous(f"tcp://{addr}:{port}", world.rank, world.world_size, timeout=timeout))[0]
    if world.rank != 0:
        return dist.TCPStore(addr, port, world.world_size, is_master=False, timeout=timeout)
    if (addr, port) not in _SERVERS:  # a later group of this process reuses it, under a new prefix
        one_node = world.num_nodes == 1
        _SERVERS[(addr, port)] = listening_store(addr, port, world.world_size, timeout, True, one_node)
    return _SERVERS[(addr, port)]


def listening_store(
    addr: str, port: int, world_size: int, timeout: timedelta, wait: bool, one_node: bool = True
) -> dist.TCPStore:
    """A TCPStore server bound to ``addr`` alone (127.0.0.1 locally, the master address elsewhere).

    torch's own binds every interface (``::``) and has no bind address: the stores take no password,
    so anyone who reaches the port could read and write them. The socket is bound here and handed over.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    everywhere = False
    if not one_node and ipaddress.ip_address(sockaddr[0]).is_loopback and not is_loopback_name(addr):
        # A host name (mpiexec's rank 0 posts its own) that /etc/hosts maps to 127.0.1.1 here while
        # the other nodes resolve it to its real address: only every interface reaches them all.
        family, sockaddr, everywhere = socket.AF_INET6, ("::", port), True
    try:
        sock = socket.create_server(
            sockaddr, family=family, backlog=max(128, world_size), dualstack_ipv6=everywhere
        )
    except OSError as e:
        raise CommTimeout(f"cannot listen on {addr}:{port} for the run's store: {e.strerror}") from None
    return dist.TCPStore(
        addr,
        sock.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait,
        master_listen_fd=sock.detach(),
    )


def is_loopback_name(addr: str) -> bool:
    """``localhost`` or a loopback address literal.

    >>> is_loopback_name("127.0.0.1"), is_loopback_name("localhost"), is_loopback_name("node1")
    (True, True, False)
    """
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def destroy_distributed() -> None:
    """Without this, gloo workers sometimes abort at exit ("terminate called without an active
    exception")."""
    global _ELASTIC
    if _ELASTIC is not None:
        _ELASTIC.close()
        _ELASTIC = None
    if dist.is_initialized():
        destroy_default_group()


# A rank's heartbeat for its launcher, which kills a rank 0 that shows no progress for --timeout once
# it is the last rank running, and an MPI job none of whose ranks shows progress: the rank's metrics
# file has its time set at most once a second by post(), called every step, so a slow but healthy
# rank is seen alive between its metrics' flushes.
HEARTBEAT_EVERY_S = 1.0


def heartbeat_file() -> str | None:
    """This rank's metrics file (rank 0's ``metrics.jsonl``, ``metrics.rank{r}.jsonl`` for the others),
    touched as it steps; None outside the local launcher (which names rank 0's in the environment)."""
    env = os.environ
    path, rank = env.get(HEARTBEAT_ENV), env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK")
    if not path or rank is None:
        return None
    return path if rank == "0" else os.path.join(os.path.dirname(path), f"metrics.rank{rank}.jsonl")


_LIFE: tuple[object, str] | None = None  # (the default group, its token)


def life_token() -> str:
    """A token that every rank of the default process group shares and no earlier group had, drawn by
    rank 0 and broadcast (a collective: every rank calls it, in the same order as its other
    collectives). Keys the ranks post in the group's store go under it: torchrun's agents keep one
    store across restarts (its default), so a key of the dead life would otherwise be read as this
    life's (a board address nobody serves: a 30 s connect timeout; an old box's name)."""
    global _LIFE
    group = dist.distributed_c10d._get_default_group()
    if _LIFE is None or _LIFE[0] is not group:
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0)
        _LIFE = (group, token[0])
    return _LIFE[1]


# Boards made in this process so far: every rank makes its boards in the same order, so the n-th
# board's address goes under a key of its own (a later board never finds an earlier one's address).
_BOARDS = itertools.count()


class ProgressBoard:
    """A small key-value store of its own (the process group's may be broken by a failed
    collective) through which ranks that time out in a collective find out which peers never
    arrived, so that the error names them instead of only saying "timed out"."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.step = -1
        self._beat = 0.0  # when post() last touched the heartbeat
        if not dist.is_initialized() or dist.get_world_size() == 1 or _ELASTIC is not None:
            return  # (a run that survives in place names lost peers its own way: runtime/elastic.py)
        from torch.distributed.distributed_c10d import _get_default_store

        pg_store, rank = _get_default_store(), dist.get_rank()
        addr, key = (
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            f"parambox/board/{life_token()}/{next(_BOARDS)}",
        )
        if rank == 0:
            world_size, timeout = dist.get_world_size(), timedelta(seconds=30)
            self.store = listening_store(addr, 0, world_size, timeout, wait=False)
            pg_store.set(key, f"{addr}:{self.store.port}")
        else:
            host, port = pg_store.get(key).decode().rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        self.store.set_timeout(timedelta(seconds=5))

    def close(self) -> None:
        """Drop the store (before the process group goes: see ``destroy_distributed``)."""
        self.store = None

    def post(self, step: int) -> None:
        self.step = step  # local only: the hot path never talks to the store
        now = time.monotonic()
        if now - self._beat >= HEARTBEAT_EVERY_S:
            self._beat = now
            heartbeat = heartbeat_file()  # (read now: a worker forked from the zygote got its env late)
            if heartbeat:
                with contextlib.suppress(OSError):  # not made yet, or its run directory gone
                    os.utime(heartbeat)

    def missing_ranks(self, phase: str, grace_s: float = 2.0) -> list[int]:
        """After a timeout: every rank that reached this collective timed out too and says so here;
        the ranks that stay silent for ``grace_s`` are the ones that never arrived. Bounded: the store
        lives in rank 0, and a stopped rank 0 (SIGSTOP, a suspended job, a frozen host) accepts the
        connection but never answers, and ``TCPStore.check`` has no timeout of its own."""
        if self.store is None:
            return []
        found: list[list[int]] = []
        asking = threading.Thread(target=lambda: found.append(self._ask(phase, grace_s)), daemon=True)
        asking.start()
        asking.join(grace_s + STORE_ANSWER_S)
        return found[0] if found else [0]  # no answer: the store's host, rank 0, is stalled

    def _ask(self, phase: str, grace_s: float) -> list[int]:
        assert self.store is not None
        world, me = dist.get_world_size(), dist.get_rank()
        keys = [f"timeout/{self.step}/{phase}/{r}" for r in range(world)]
        deadline = time.monotonic() + grace_s
        try:
            self.store.set(keys[me], "1")
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.05)
            return [r for r in range(world) if not self.store.check([keys[r]])]
        except Exception:  # the store's host (rank 0) is gone
            return [0]


@contextmanager
def collective(phase: str, board: ProgressBoard | None = None) -> Iterator[None]:
    """Wrap blocking communication: a timeout becomes a ``CommTimeout`` naming the phase, the step and
    the missing ranks (those the run's ``board`` finds silent; without a board, the phase alone)."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if "imeout" not in text and "imed out" not in text and "closed" not in text.lower():
            raise
        who = board.missing_ranks(phase) if board is not None else []
        missing = f"ranks not arrived: {who}" if who else "a peer closed the connection or stalled"
        step = board.step if board is not None else "?"
        raise CommTimeout(f"{phase} at step {step} timed out: {missing}") from None
