"""A synchronous run that survives in place (``on_failure = "shrink"``): when a worker dies or stalls,
the others go on as a smaller group over a new process group, without a restart and without disk.

The local launcher hosts a key-value store of its own (a ``TCPStore`` in the launcher process: it
outlives every worker, unlike the usual rendezvous store on rank 0) and names it to the workers in
``PARAMBOX_GROUP_STORE``. Generation ``g`` of the group is a gloo process group over the prefix
``gen{g}/`` of that store, so a new generation never reads an old one's addresses.

A collective that fails (a peer's connection closed: it died; or ``--timeout`` passed: it stalled)
raises :class:`PeerLost` in each survivor. Each then:

1. destroys its old process group (which closes its sockets, so a survivor still blocked on *it*
   fails at once instead of at its own timeout);
2. checks in for generation ``g + 1`` with the step it was at;
3. the first to check in (a ticket from the store's atomic ``add``) decides the members: every rank of
   generation ``g`` that checked in once all the others are dead on the launcher's board, or once
   ``--timeout`` passed (a stalled rank never checks in). It writes them, and the ranks it leaves out
   (*fenced*), under ``gen{g+1}/``; the launcher reads the fenced ranks and SIGKILLs them;
4. a rank that finds itself outside the members raises :class:`Fenced` (a stalled rank that wakes:
   its old group is gone, so nothing it sends reaches the survivors); the members join the new group.

A replacement (``--max-restarts``; the launcher starts it at once, so the dead rank's board life is
newer and nobody waits for it) asks to join in the store; group rank 0 names the step at which it
comes in (after the next exchange every member must pass with rank 0, so all have read the plan);
at the start of that step the members and the replacement form the next generation, and rank 0
broadcasts its weights and resume state to it (``Strategy.share_state``).

The survivors then repeat the exchange that failed (``Strategy.exchange``), so the step ends as if
the dead rank had never taken part in it.

A rank that dies at the very end of a collective can leave the survivors one step apart: gloo's ring
delivered everything some of them needed (they finished the step and failed in the next one) while a
send of another failed (it failed in this one). The members then check in with two steps, ``s`` and
``s + 1``; :attr:`ElasticGroup.lag` names the lowest-ranked member at ``s + 1`` and whether this rank
is behind, and the strategy's ``catch_up`` gives the ranks behind that member's state (which has step
``s``'s update, made with the dead rank's contribution), as a replacement receives it. A strategy
without ``catch_up`` raises, and the run falls back to restart-all (``--max-restarts``) or fails, as
it does for members further apart.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Before any process group exists. At import, torch.distributed.nn.functional's ten collectives bind
# the default group of that moment as a default argument (``group=group.WORLD``); the first optimizer
# imports it (through torch._dynamo). A group made before that import was then held for good:
# destroy_process_group left its sockets and threads open, so a peer blocked on a rank that had
# regrouped waited its whole --timeout (under mpiexec, where no warm zygote imported it first), and
# every regroup kept the old group. 3 ms.
import torch.distributed.nn.functional  # noqa: F401  isort: skip

from parambox.errors import CommTimeout
from parambox.runtime import signed
from parambox.runtime.control import WorkerBoard, current_life, joins_from, rejoining

STORE_ENV = "PARAMBOX_GROUP_STORE"  # host:port of the launcher's store in a run that survives in place
GROUP_LIFE_ENV = "PARAMBOX_GROUP_LIFE"  # restarts of the whole group so far: each runs the protocol afresh
JOINS_KEY = "joins"  # replacements that asked to join so far (a counter)
FORMED_KEY = "formed"  # every rank adds 1 once it is in generation 0: deaths after that are survived
FENCED_KEY = "fenced"  # the ranks (of the launch) the survivors left out, JSON; the launcher kills them
_POLL_S = 0.05


def destroy_default_group() -> None:
    """``dist.destroy_process_group()``, after a pause with the GIL released.

    A gloo process group's run-loop thread frees a finished collective's work just after the caller's
    ``wait`` returns, and that needs the GIL when the work holds Python tensors. The group's destructor
    (here, or later when its last holder, a DDP reducer or a strategy, is freed) runs under the GIL
    and joins the run-loop threads: if one was still freeing such a work, neither thread moved again.
    Seen at the end of 1 in 25 runs of ``bench optimizer`` (gdb: ``~ProcessGroupGloo`` joining
    ``pt_gloo_runloop``, itself in ``take_gil`` under ``~AsyncBroadcastWork``)."""
    time.sleep(0.05)
    with suppress(Exception):
        if dist.is_initialized() and dist.get_backend() == "nccl":
            # nccl's destroy may wait on a collective a dead peer never finishes: abort, as torchft does
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()


class UlfmBoard:
    """What the local launcher's board tells (dead ranks, lives), from ULFM under ``mpiexec --with-ft
    ulfm``: a rank is dead once MPI knows it failed; nobody is replaced (one MPI job). ``agree`` shrinks
    the MPI communicator to the survivors and has them agree on the step, as ULFM's recovery does."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD  # the survivors' communicator: COMM_WORLD, then each shrink of it
        self.ranks = list(range(self.comm.Get_size()))  # its ranks in COMM_WORLD

    def dead_ranks(self) -> list[int]:
        from mpi4py import MPI

        from parambox.runtime.mpi import failed_ranks

        return failed_ranks(MPI.COMM_WORLD)

    def life(self, rank: int) -> int:
        return 0

    def agree(self, members: list[int], step: int, timeout_s: float) -> None:
        """``MPI_Comm_shrink`` to the live ranks, then ``MPI_Comm_agree`` among them on ``step`` (the
        bitwise AND of every member's: the newest step a member checked in with, as each read it from
        the store). Both are collective over every live rank: the caller skips them where the group
        left out a rank that is alive (a stalled one, fenced), and the store's word stands alone there."""
        import numpy as np
        from mpi4py import MPI

        from parambox.runtime.mpi import await_request

        shrunk = self.comm.Shrink()
        mine, old = shrunk.Get_group(), self.comm.Get_group()
        self.ranks = [self.ranks[r] for r in mine.Translate_ranks(list(range(shrunk.Get_size())), old)]
        mine.Free()
        old.Free()
        if self.comm != MPI.COMM_WORLD:
            self.comm.Free()
        self.comm = shrunk
        if sorted(self.ranks) != sorted(members):
            raise CommTimeout(f"regrouping: MPI's survivors {self.ranks} are not the group's {members}")
        flag = np.array([step], dtype=np.int32)
        await_request(
            shrunk.Iagree(flag),
            time.monotonic() + timeout_s,
            lambda: f"regrouping: the members {members} did not agree within {timeout_s:g} s",
        )
        if int(flag[0]) != step:
            raise CommTimeout(f"regrouping: the members {members} are not all at step {step}")


@dataclass(frozen=True)
class Lag:
    """The members of a new generation checked in one step apart (see the module docstring)."""

    src: int  # the group rank, in the new generation, whose state the ranks behind take
    behind: bool  # this rank is at the earlier step: its exchange failed where the leader's did not
    steps: dict[int, int]  # launch rank -> the step it checked in with

    def why(self) -> str:
        return (
            f"the surviving ranks {sorted(self.steps)} stopped at different steps "
            f"{sorted(set(self.steps.values()))} (a failure inside a collective): they cannot go on in place"
        )


class PeerLost(RuntimeError):
    """A collective failed because a peer died or stalled; the group can go on without it."""


class Fenced(CommTimeout):
    """This rank stalled past the others' timeout and was left out of the group."""


def host_store() -> tuple[dist.TCPStore, str]:
    """The launcher's store (on loopback) and its address for the workers' environment."""
    from parambox.runtime.dist import listening_store  # (dist imports this module)

    # Bound to loopback alone, as the run's own stores (torch's would listen on every interface).
    store = listening_store("127.0.0.1", 0, 1, timedelta(seconds=300), wait=False)
    signed.host_secret(store)  # the workers get it in signed.SECRET_ENV (store_env)
    return store, f"127.0.0.1:{store.port}"


def store_env(store: dist.TCPStore, address: str) -> dict[str, str]:
    """What a worker needs in its environment to use the launcher's ``store`` at ``address``: the
    address, and the run's secret that signs the values the ranks and the launcher act on."""
    return {STORE_ENV: address, signed.SECRET_ENV: signed.secret_of(store) or ""}


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def broadcast_state(state: dict | None, src: int = 0) -> dict:
    """Group rank ``src``'s ``state`` (tensors, numbers, strings in dicts and lists) on every rank of the
    current group: ``torch.save`` bytes in two broadcasts, read back with ``weights_only=True`` (no
    pickle)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = torch.empty(0, dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, async_op=True).wait()
    if dist.get_rank() != src:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, async_op=True).wait()
    if dist.get_rank() == src:
        return state
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True, map_location="cpu")


def fenced_ranks(store: dist.Store) -> list[int]:
    """The ranks the survivors left out so far (the launcher's view); [] before any."""
    with suppress(Exception):
        if store.check([FENCED_KEY]):
            value = signed.read(store, FENCED_KEY)  # None: not written by the run, ignored
            return json.loads(value) if value is not None else []
    return []


class ElasticGroup:
    """The current generation of a run's process group, and how it goes on without lost ranks.

    ``rank`` is this process's rank at launch (its data shard, its logs); ``group_rank`` and
    ``group_size`` are its place in the current generation, oldest members first: group rank 0 leads
    the run (rank 0 of the launch until it dies, then the oldest survivor: the lowest-ranked one of
    the launch, where no replacement joined)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, backend: str):
        self.store, self.rank, self.timeout_s, self.backend = store, rank, timeout_s, backend
        self.world_size = world_size
        # Generation 0: every rank of the launch, or those below JOIN_FROM_ENV (the others join later).
        self.members = list(range(joins_from(world_size)))
        self.generation = 0
        self.board = WorkerBoard.from_env()
        # How long the decider waits for members still on their way: --timeout and a quarter (at least
        # 1 s). A live member blocked in a collective that fails only at its own --timeout (begun before
        # the decider's, which failed at once: a send to a dead peer) checks in within --timeout of the
        # decider, plus its way here; at --timeout alone it lost that race (1 run of 2 of the step-apart
        # test under mpiexec). A stalled rank is so fenced after about twice --timeout (the
        # collective's, then this) where the launcher has not killed it first (a rank the kernel shows
        # stopped for --timeout); a live one that a loaded machine starves for seconds is not mistaken
        # for it.
        self.grace_s = timeout_s + max(1.0, 0.25 * timeout_s)
        self.lives = self._lives()  # each member's life: a replacement (a later life) is not waited for
        self.joined_at: int | None = None  # a replacement: the step at which it joined
        self.lag: Lag | None = None  # after a regroup whose members were one step apart
        self.admitted = 0  # replacements admitted so far (group rank 0 counts)

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float, backend: str) -> ElasticGroup | None:
        address = os.environ.get(STORE_ENV)
        if not address or world_size == 1:
            return None
        # Each restart of the whole group (a life) runs the protocol afresh: keys of its own.
        life = os.environ.get(GROUP_LIFE_ENV, "0")
        store = dist.PrefixStore(f"life{life}", connect_store(address, timeout_s))
        return cls(store, rank, world_size, timeout_s, backend)

    @classmethod
    def under_mpi(cls, world, timeout_s: float) -> ElasticGroup:
        """Under ``mpiexec --with-ft ulfm`` (no local launcher): rank 0 serves the store (its death is
        not survived in place anyway), ULFM says which ranks died, and the members of each new
        generation agree on it over an MPI communicator of their own (``MPI_Comm_agree``)."""
        from parambox.runtime.dist import rendezvous_address, rendezvous_store

        addr, port = rendezvous_address(world, timeout_s)
        store = rendezvous_store(world, addr, port, timedelta(seconds=timeout_s))
        group = cls(
            dist.PrefixStore("elastic", store), world.rank, world.world_size, timeout_s, world.backend
        )
        group.board = UlfmBoard()
        group.lives = group._lives()
        return group

    @property
    def group_rank(self) -> int:
        return self.members.index(self.rank)

    @property
    def group_size(self) -> int:
        return len(self.members)

    def _lives(self) -> dict[int, int]:
        return {r: self.board.life(r) if self.board is not None else 0 for r in self.members}

    @property
    def joins_late(self) -> bool:
        """This process joins a running group: a replacement, or a rank beyond the group's start."""
        return rejoining() or self.rank not in self.members

    def join(self) -> None:
        """Generation 0: every rank of the launch; a replacement (or a rank beyond the group's start)
        waits to be admitted instead."""
        if self.joins_late:
            self._join_late()
            return
        self._init(0)
        self.store.add(FORMED_KEY, 1)

    # -- replacements: admitted at a step boundary --------------------------------------------------
    def _join_late(self) -> None:
        key = f"admit/{self.rank}/{current_life()}"
        signed.put(self.store, f"join/{self.rank}", str(current_life()))
        self.store.add(JOINS_KEY, 1)
        # The survivors admit at a step boundary after they regrouped; a warm start may ask first.
        word = json.loads(self._get(key, wait_s=2 * self.timeout_s))
        self.members, self.generation, self.joined_at = word["members"], word["generation"], word["step"]
        self.lives = self._lives()
        self._init(self.generation)

    def admission(self, step: int, next_exchange: int) -> dict | None:
        """At the start of ``step``, on every member: the replacements that join now, if any. Group rank 0
        sees new ones and names them and the step after ``next_exchange`` (the next step whose exchange
        every member must pass with rank 0: none can begin the step after it without having read the
        store after rank 0 wrote); the others read the plan. A store round trip or two per step."""
        if self.group_rank == 0:
            asked = int(self.store.add(JOINS_KEY, 0))
            asking = [r for r in range(self.world_size) if self._asked(r)] if asked > self.admitted else []
            # A replacement that asks before the group has regrouped without its rank (a warm start
            # takes well under a second) waits for that regroup: admitted now, it would be left out.
            if asked > self.admitted and not any(r in self.members for r in asking):
                self.admitted = asked
                if asking:
                    plan = {"step": next_exchange + 1, "ranks": asking}
                    signed.put(self.store, "admit_at", json.dumps(plan))
        if not self.store.check(["admit_at"]):
            return None
        plan = json.loads(self._get("admit_at"))
        return plan if plan["step"] == step and self.rank not in plan["ranks"] else None

    def admit(self, plan: dict) -> None:
        """Every member at the start of the planned step: the named replacements come in (generation + 1)."""
        # the newcomers last: group rank 0, the leader, stays the oldest member (a replacement of
        # rank 0 joins as any other rank)
        members = self.members + [r for r in sorted(plan["ranks"]) if r not in self.members]
        gen = self.generation + 1
        if self.group_rank == 0:
            word = json.dumps({"members": members, "generation": gen, "step": plan["step"]})
            for r in plan["ranks"]:
                signed.put(self.store, f"admit/{r}/{self._get(f'join/{r}')}", word)
                self.store.delete_key(f"join/{r}")  # answered: a later death of r asks anew
        destroy_default_group()
        self.members, self.generation = members, gen
        self.lives = self._lives()
        self._init(gen)

    def _asked(self, rank: int) -> bool:
        return self.store.check([f"join/{rank}"])

    def _init(self, generation: int) -> None:
        store = dist.PrefixStore(f"gen{generation}", self.store)
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            # A failed collective raises in the rank that waits on it (and its communicator is aborted)
            # instead of NCCL's watchdog ending the process: the survivors regroup as over gloo. Only
            # where the caller waits on a Work: the strategies' guarded collectives are started with
            # async_op=True and waited on. A synchronous NCCL collective returned at once, and the
            # survivors of a weight-avg run hung in the next host sync on the GPU, with no error.
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # (what _abort_process_group asks)
        dist.init_process_group(
            self.backend, store=store, rank=self.group_rank, world_size=self.group_size, timeout=timeout
        )

    @contextmanager
    def guard(self, phase: str, step: int | None = None) -> Iterator[None]:
        """Blocking communication whose failure means a lost peer: ``PeerLost`` naming the phase."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(f"{phase} at step {step}: {(str(e).splitlines() or [''])[0]}") from None

    def regroup(self, step: int) -> None:
        """Go on without the ranks that are gone (see the module docstring); ``Fenced`` if this rank
        is one of them."""
        destroy_default_group()  # closes our sockets: peers blocked on us fail now
        gen = self.generation + 1
        prefix = f"gen{gen}/"
        signed.put(self.store, f"{prefix}in/{self.rank}", str(step))
        if self.store.add(f"{prefix}ticket", 1) == 1:
            self._decide(prefix)
        decided = json.loads(self._get(f"{prefix}members"))
        if self.rank not in decided:
            raise Fenced(f"rank {self.rank} stalled past the others' timeout and was left out of the group")
        at = {r: int(self._get(f"{prefix}in/{r}")) for r in decided}
        self.lag = None
        if len(set(at.values())) > 1:
            ahead = max(at.values())
            self.lag = Lag(decided.index(min(r for r in decided if at[r] == ahead)), step < ahead, at)
            if ahead - min(at.values()) > 1:
                raise CommTimeout(self.lag.why())
        self.members, self.generation = decided, gen
        self.lives = {r: self.lives[r] for r in decided}
        if isinstance(self.board, UlfmBoard) and not json.loads(self._get(f"{prefix}fenced")):
            # every rank left out is dead: MPI can agree (on the newest step, which every member read)
            self.board.agree(decided, max(at.values()), self.timeout_s)
        self._init(gen)

    def _decide(self, prefix: str) -> None:
        """The decider of a generation: who is in (checked in), who is fenced (stalled)."""
        deadline = time.monotonic() + self.grace_s
        while True:
            arrived = [r for r in self.members if self.store.check([f"{prefix}in/{r}"])]
            dead = set(self.board.dead_ranks()) if self.board is not None else set()
            waiting = [r for r in self.members if r not in arrived and r not in dead and not self._renewed(r)]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        fenced = [r for r in waiting if r not in arrived]
        if fenced:
            signed.put(
                self.store, FENCED_KEY, json.dumps(sorted(set(fenced_ranks(self.store)) | set(fenced)))
            )
        signed.put(self.store, f"{prefix}fenced", json.dumps(fenced))
        signed.put(self.store, f"{prefix}members", json.dumps(arrived))

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that the launcher's board (or ULFM) shows dead or replaced: what a wait on
        peers that sockets do not watch (the box's barrier) polls to end at once, not at its timeout."""
        dead = set(self.board.dead_ranks()) if self.board is not None else set()
        return [r for r in ranks if r in dead or self._renewed(r)]

    def _renewed(self, rank: int) -> bool:
        """A later life of ``rank`` (a replacement) runs: the member of that rank is gone."""
        return self.board is not None and self.board.life(rank) > self.lives.get(rank, 0)

    def _get(self, key: str, wait_s: float | None = None) -> str:
        try:  # the decider may take its grace, then the store its round trip
            wait_s = self.grace_s + self.timeout_s if wait_s is None else wait_s
            self.store.wait([key], timedelta(seconds=wait_s))
            value = signed.read(self.store, key)
        except RuntimeError as e:  # the store's own timeout: the decider died too
            raise CommTimeout(f"regrouping: no word on {key!r} within {wait_s:g} s") from e
        if value is None:  # a process without the run's secret wrote it: not obeyed
            raise CommTimeout(f"regrouping: {key!r} in the run's store is not signed with the run's secret")
        return value

    def close(self) -> None:
        self.store = None
