"""Who am I and who are my peers: rank, sizes, node and device, read from any launcher's environment."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from parambox.errors import UserError

# Set by parambox's own local launcher on the workers it spawns.
LOCAL_LAUNCHER_ENV = "PARAMBOX_LOCAL_LAUNCHER"
# cpu | cuda: where the workers run; unset, a GPU per local rank where torch sees one, else the CPU.
DEVICE_ENV = "PARAMBOX_DEVICE"


@dataclass(frozen=True)
class World:
    """This process's place in the run.

    >>> w = World.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    >>> (w.rank, w.world_size, w.launcher)
    (1, 2, 'torchrun')
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    launcher: str = "none"  # none | local | torchrun | slurm | mpi
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        # The one place that picks a device: a GPU per local rank where there is one.
        if _wants_gpu():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World:
        env = os.environ if env is None else env
        for reader in (_local, _torchrun, _slurm, _openmpi, _pmi):
            world = reader(env)
            if world is not None:
                return _checked(world)
        return cls()


def _wants_gpu() -> bool:
    wanted = os.environ.get(DEVICE_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise UserError(f"{DEVICE_ENV}={wanted!r}: choose cpu or cuda (unset: a GPU where there is one)")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{DEVICE_ENV}=cuda, but torch sees no GPU (torch {torch.__version__})")
    return wanted != "cpu" and torch.cuda.is_available()


def check_gpus(ranks_per_node: int) -> None:
    """Refuse, in one line, more ranks on a node than it has GPUs where they would run on GPUs: NCCL
    takes one GPU per rank (else every rank fails with its "Duplicate GPU detected"). A rank that
    names its own ``NCCL_HOSTID`` is taken as a host of its own (a test of the nccl path on one GPU,
    over NCCL's socket transport)."""
    if not _wants_gpu() or os.environ.get("NCCL_HOSTID"):
        return
    gpus = torch.cuda.device_count()
    if ranks_per_node > gpus:
        raise UserError(
            f"{ranks_per_node} ranks on this node share {gpus} GPU{'s' * (gpus != 1)}, and NCCL takes one "
            f"GPU per rank: run at most {gpus} per node, or on the CPU with {DEVICE_ENV}=cpu"
        )


def under_external_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when torchrun, srun or mpiexec started this process (so it is one worker of many)."""
    env = os.environ if env is None else env
    return World.from_env(env).launcher not in ("none", "local") or LOCAL_LAUNCHER_ENV in env


def _int(env: Mapping[str, str], *keys: str, default: int | None = None) -> int | None:
    """The first of ``keys`` set (and not empty) in ``env`` as an int; a launcher's value that is not
    one is a ``UserError`` naming the variable."""
    for k in keys:
        value = env.get(k, "")
        if value != "":
            try:
                return int(value)
            except ValueError:
                raise UserError(f"{k}={value!r} in the environment is not an integer") from None
    return default


def _need(env: Mapping[str, str], key: str) -> int:
    """``key``, which the launcher must set, as an int."""
    value = _int(env, key)
    if value is None:
        raise UserError(f"{key} is empty in the environment: the launcher must set it to an integer")
    return value


def _checked(world: World) -> World:
    """``world`` if its numbers can be a run's; else a ``UserError`` naming the first that cannot."""
    port = world.master_port
    problems = [
        (world.world_size < 1, f"a world size of {world.world_size}"),
        (not 0 <= world.rank < world.world_size, f"rank {world.rank} of {world.world_size}"),
        (world.local_world_size < 1, f"a local world size of {world.local_world_size}"),
        (world.local_rank < 0, f"local rank {world.local_rank}"),
        (
            world.num_nodes < 1 or not 0 <= world.node_rank < world.num_nodes,
            f"node {world.node_rank} of {world.num_nodes}",
        ),
        (port is not None and not 0 < port < 65536, f"MASTER_PORT {port}"),
    ]
    for bad, what in problems:
        if bad:
            raise UserError(f"the {world.launcher} launcher's environment gives {what}: not a place in a run")
    return world


def _nodes(world_size: int, local_world_size: int) -> int:
    return max(1, -(-world_size // max(1, local_world_size)))


def _local(env):
    if LOCAL_LAUNCHER_ENV not in env:
        return None
    n = _need(env, "WORLD_SIZE")
    # On an emulated cluster (--emulate-nodes) the launcher places ranks on nodes and says where.
    return World(
        _need(env, "RANK"),
        n,
        _need(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE", default=n),
        _int(env, "PARAMBOX_NODE_RANK", default=0),
        _int(env, "PARAMBOX_NUM_NODES", default=1),
        "local",
        env.get("MASTER_ADDR"),
        _int(env, "MASTER_PORT"),
    )


def _torchrun(env):
    if (
        "RANK" not in env
        or "WORLD_SIZE" not in env
        or "TORCHELASTIC_RUN_ID" not in env
        and "LOCAL_RANK" not in env
    ):
        return None
    rank, size = _need(env, "RANK"), _need(env, "WORLD_SIZE")
    local_size = _int(env, "LOCAL_WORLD_SIZE", default=size)
    node = _int(env, "GROUP_RANK", default=rank // max(1, local_size))
    return World(
        rank,
        size,
        _int(env, "LOCAL_RANK", default=0),
        local_size,
        node,
        _nodes(size, local_size),
        "torchrun",
        env.get("MASTER_ADDR"),
        _int(env, "MASTER_PORT"),
    )


def _slurm(env):
    # SLURM_STEP_ID is set only inside an `srun` step, not in the batch script itself.
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1)
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", default=1)
    local_size = _slurm_tasks_on_node(env, size, nodes)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
    job = _int(env, "SLURM_JOB_ID", default=0)
    # Below Linux's ephemeral range (32768 and up), where a port another connection holds would refuse the store.
    port = _int(env, "MASTER_PORT", default=20000 + (job * 7 + _int(env, "SLURM_STEP_ID", default=0)) % 12000)
    return World(
        _need(env, "SLURM_PROCID"),
        size,
        _int(env, "SLURM_LOCALID", default=0),
        local_size,
        _int(env, "SLURM_NODEID", default=0),
        nodes,
        "slurm",
        env.get("MASTER_ADDR") or first_host(nodelist),
        port,
    )


def _slurm_tasks_on_node(env, size: int, nodes: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1"; our node's entry is what we need.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return -(-size // nodes)
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID", default=0)
    return counts[node] if node < len(counts) else counts[-1]


def _openmpi(env):
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    size = _need(env, "OMPI_COMM_WORLD_SIZE")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=size)
    return World(
        _need(env, "OMPI_COMM_WORLD_RANK"),
        size,
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
        local_size,
        _need(env, "OMPI_COMM_WORLD_RANK") // max(1, local_size),
        _nodes(size, local_size),
        "mpi",
        env.get("MASTER_ADDR"),
        _int(env, "MASTER_PORT"),
    )


def _pmi(env):
    if "PMI_RANK" not in env:
        return None
    size = _int(env, "PMI_SIZE", default=1)
    local_size = _int(env, "MPI_LOCALNRANKS", default=size)
    rank = _need(env, "PMI_RANK")
    return World(
        rank,
        size,
        _int(env, "MPI_LOCALRANKID", default=rank % max(1, local_size)),
        local_size,
        rank // max(1, local_size),
        _nodes(size, local_size),
        "mpi",
        env.get("MASTER_ADDR"),
        _int(env, "MASTER_PORT"),
    )


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list: ``node[03-05,07],gpu1`` -> ``node03``."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        return nodelist
    prefix, ranges = head.group(1), head.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
