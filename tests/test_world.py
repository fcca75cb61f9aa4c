"""Tier (a): World is read correctly from every launcher's environment."""

from __future__ import annotations

import pytest

from parambox.errors import UserError
from parambox.runtime.world import World, first_host, under_external_launcher


def test_no_launcher():
    w = World.from_env({})
    assert (w.rank, w.world_size, w.launcher) == (0, 1, "none")
    assert not under_external_launcher({})


def test_torchrun():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    w = World.from_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes) == (
        5,
        8,
        1,
        4,
        1,
        2,
    )
    assert (w.launcher, w.master_addr, w.master_port) == ("torchrun", "n1", 29500)
    assert under_external_launcher(env)


def test_slurm_step():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "1234",
    }
    w = World.from_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes) == (
        3,
        6,
        0,
        3,
        1,
        2,
    )
    assert w.launcher == "slurm" and w.master_addr == "gpu07" and 20000 <= w.master_port < 32000


def test_slurm_batch_script_is_not_a_worker():
    # Inside the sbatch script itself (no srun step) parambox must launch, not act as one rank.
    assert World.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}).launcher == "none"


def test_uneven_slurm_tasks_per_node():
    env = {
        "SLURM_PROCID": "4",
        "SLURM_STEP_ID": "1",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "SLURM_JOB_NODELIST": "a,b",
    }
    assert World.from_env(env).local_world_size == 2


def test_openmpi_and_pmi():
    w = World.from_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.node_rank, w.num_nodes, w.launcher) == (
        3,
        4,
        1,
        1,
        2,
        "mpi",
    )
    w = World.from_env({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (w.rank, w.world_size, w.launcher) == (2, 3, "mpi")


def test_first_host():
    assert first_host("node[03-05,07],gpu1") == "node03"
    assert first_host("login1") == "login1"
    assert first_host("a,b") == "a"


def test_the_device_is_a_gpu_per_local_rank_unless_told_cpu(monkeypatch):
    import pytest
    import torch

    from parambox.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("PARAMBOX_DEVICE", raising=False)
    w = World(rank=3, world_size=4, local_rank=3, local_world_size=4)
    assert (str(w.device), w.backend) == ("cuda:1", "nccl")
    monkeypatch.setenv("PARAMBOX_DEVICE", "cpu")
    assert (str(w.device), w.backend) == ("cpu", "gloo")
    monkeypatch.setenv("PARAMBOX_DEVICE", "gpu")
    with pytest.raises(UserError, match="PARAMBOX_DEVICE='gpu': choose cpu or cuda"):
        _ = w.device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PARAMBOX_DEVICE", "cuda")
    with pytest.raises(UserError, match="torch sees no GPU"):
        _ = w.device


def test_more_ranks_on_a_node_than_gpus_is_refused_in_one_line(monkeypatch):
    import pytest
    import torch

    from parambox.errors import UserError
    from parambox.runtime.world import check_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("PARAMBOX_DEVICE", "NCCL_HOSTID"):
        monkeypatch.delenv(name, raising=False)
    check_gpus(1)
    with pytest.raises(UserError, match="2 ranks on this node share 1 GPU, and NCCL takes one GPU per rank"):
        check_gpus(2)
    monkeypatch.setenv("PARAMBOX_DEVICE", "cpu")
    check_gpus(2)  # on the CPU: gloo, any number
    monkeypatch.delenv("PARAMBOX_DEVICE")
    monkeypatch.setenv("NCCL_HOSTID", "a-host-of-its-own")  # scripts/gpu_check.py's one-GPU check
    check_gpus(2)


BAD_LAUNCHER_ENVS = [
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "z"}, "LOCAL_RANK='z'"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='x'"),
    ({"RANK": "", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is empty"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT 70000"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "rank 2 of 2"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, "world size of 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "local rank -1"),
    ({"SLURM_PROCID": "x", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x'"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "q"}, "OMPI_COMM_WORLD_SIZE='q'"),
    ({"PMI_RANK": "3", "PMI_SIZE": "2"}, "rank 3 of 2"),
    (
        {
            "PARAMBOX_LOCAL_LAUNCHER": "1",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "PARAMBOX_NODE_RANK": "1",
        },
        "node 1 of 1",
    ),
]


@pytest.mark.parametrize("env,piece", BAD_LAUNCHER_ENVS)
def test_a_bad_launcher_environment_is_a_user_error(env, piece):
    """Before: ``ValueError: invalid literal for int()`` (a traceback, exit 1), or a rank outside its
    world that hung at the rendezvous."""
    with pytest.raises(UserError) as e:
        World.from_env(env)
    assert piece in str(e.value) and "\n" not in str(e.value)
