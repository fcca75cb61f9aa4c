"""Fault injection for tests and demos: ``PARAMBOX_FAULT="RANK:STEP:KIND[,...]"``.

KIND is ``kill`` (SIGKILL this worker before the step), ``nan`` (from that step on every floating
tensor of its batch is NaN, so its loss and gradients become non-finite) ``slow`` (sleep 0.2 s per step from then on)
``hang`` (stall at that step, sleeping), ``stop`` (SIGSTOP itself at that step: frozen, it holds its
connections open and answers nothing, until its launcher kills it), ``partition=T`` (on an emulated
node: take the node's link down for T seconds, then up again; the process trains on, its messages
wait in TCP's retransmissions) or ``lose-exchange`` (a run that survives in place: the step's
exchange fails on this rank after it finished on the others, as when a peer dies at the very end of
a collective and this rank's last send to it fails: the others go on to the next step); in a
``--resume`` life, ``kill-resume`` (SIGKILL this worker as it restores its checkpoint; STEP is
ignored); ``kill-join`` (SIGKILL this worker as it is about to join its process group, before any
peer has heard of it; STEP is ignored: ``parambox.runtime.dist.init_distributed``). The plan is
read once, in set-up, and handed to the loop (``lose-exchange`` to the strategy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from parambox.runtime import faults
from parambox.runtime.faults import partition_seconds
from parambox.strategies.tensors import map_tensors

__all__ = ["FaultPlan", "partition", "partition_seconds"]


class FaultPlan(faults.FaultPlan):
    """The faults to inject, as ``(rank, step, kind)``; empty (and false) in a normal run.

    >>> plan = FaultPlan.parse("1:20:nan"); bool(plan), plan.faults
    (True, ((1, 20, 'nan'),))
    """

    def before_restore(self, rank: int) -> None:
        """A resumed life: ``kill-resume`` SIGKILLs this worker before it loads its checkpoint."""
        if any(r == rank and kind == "kill-resume" for r, _, kind in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def inject(self, rank: int, step: int, batch: Any) -> Any:
        """Apply this rank's faults due at ``step`` to its ``batch`` (or to the process itself)."""
        for f_rank, f_step, kind in self.faults:
            if f_rank != rank or step < f_step:
                continue
            if kind == "kill" and step == f_step:
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "nan":
                batch = map_tensors(_nan_if_floating, batch)
            elif kind == "slow":
                time.sleep(0.2)
            elif kind == "hang" and step == f_step:
                time.sleep(3600)
            elif kind == "stop" and step == f_step:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind.startswith("partition") and step == f_step:
                partition(partition_seconds(kind))
        return batch


def partition(seconds: float) -> subprocess.Popen:
    """Take this emulated node's link down now, and up again after ``seconds`` from a process of its own
    (in the node's namespace, so the cluster's clean-up kills it with the node)."""
    from parambox.runtime.cluster import NODE_IFNAME

    if f" {NODE_IFNAME}:" not in Path("/proc/self/net/dev").read_text():  # this namespace's links
        raise RuntimeError("PARAMBOX_FAULT partition: not on an emulated node (--emulate-nodes)")
    # Down before this step goes on (a loaded machine starts a process late: the fault would drift to a
    # later step), up again from a process of its own while the worker trains on.
    subprocess.run(["ip", "link", "set", NODE_IFNAME, "down"], check=True)
    script = f"sleep {seconds:g}; ip link set {NODE_IFNAME} up"
    return subprocess.Popen(["sh", "-c", script], start_new_session=True)


def _nan_if_floating(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if t.is_floating_point() else t
