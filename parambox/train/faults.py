"""Fault injection for tests and demos: ``PARAMBOX_FAULT="RANK:STEP:KIND[,...]"``.

KIND is ``kill`` (SIGKILL this worker before the step), ``nan`` (feed it NaN inputs from that step
on, so its loss and gradients become non-finite) ``slow`` (sleep 0.2 s per step from then on)
or ``hang`` (stall at that step).
"""

from __future__ import annotations

import os
import signal
import time

import torch


def parse(spec: str | None) -> list[tuple[int, int, str]]:
    faults = []
    for item in (spec or "").split(","):
        if item.strip():
            rank, step, kind = item.strip().split(":")
            faults.append((int(rank), int(step), kind))
    return faults


FAULTS = parse(os.environ.get("PARAMBOX_FAULT"))


def inject(rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    for f_rank, f_step, kind in FAULTS:
        if f_rank != rank or step < f_step:
            continue
        if kind == "kill" and step == f_step:
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "nan":
            x = torch.full_like(x, float("nan"))
        elif kind == "slow":
            time.sleep(0.2)
        elif kind == "hang" and step == f_step:
            time.sleep(3600)
    return x
