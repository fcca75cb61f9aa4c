"""Surviving a lost peer in place: the runtime's side of a synchronous run whose membership changes.

A strategy is its update rule (``parambox.strategies``); what keeps its run going when a rank dies or a
replacement joins lives here, so that a change to recovery touches this module, not every rule. A rule
runs each exchange through :meth:`InPlace.exchange` and answers a small interface, :class:`Survivor`:
its state to share (``model``, ``state_dict``, ``load_state_dict``, ``load_model_state``), the step of its
next exchange (``next_exchange``: a replacement joins there) and how a rank a step behind catches up
(``catch_up``). Without an elastic group (``on_failure = "shrink"`` not set) every method is the plain
path: a collective under a timeout that names the missing ranks, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from parambox.runtime.dist import ProgressBoard, collective, elastic_group
from parambox.runtime.elastic import PeerLost, broadcast_state
from parambox.runtime.faults import FaultPlan

CAUGHT_UP = object()  # InPlace.exchange's word to a rank that took a leader's state for the step


class Survivor(Protocol):
    """What a rule answers so that its run survives in place."""

    model: torch.nn.Module

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def load_model_state(self, model_state: dict[str, torch.Tensor]) -> None: ...

    def next_exchange(self, step: int) -> int: ...

    def catch_up(self, src: int, behind: bool, why: str) -> None: ...


class InPlace:
    """One rank's membership of a run that may go on as a smaller group (or take a replacement).

    >>> class Rule:  # a rule's side of the interface, in one process
    ...     model = torch.nn.Linear(1, 1)
    >>> s = InPlace(Rule(), rank=0, world_size=1, board=None)
    >>> s.exchange(lambda: 3, step=0), s.group_size, s.joining
    (3, 1, False)
    """

    def __init__(self, rule: Survivor, rank: int, world_size: int, board: ProgressBoard | None):
        self.rule, self.rank, self.world_size, self.board = rule, rank, world_size, board
        self.group = elastic_group()  # set when the run survives a lost worker in place
        self._group_samples, self._pending_samples = 0.0, 0  # every member's samples (count_step)
        self._exchanges = self._counted = 0  # exchanges passed, and up to which the samples count
        self._awaits_state = self.joining  # a replacement, until share_state has given it a peer's state
        self._admitted_at: int | None = None  # the step admit last ran at
        self._fault = FaultPlan.from_env().exchange_fault(rank) if self.group is not None else None

    @property
    def joining(self) -> bool:
        """This process replaces a lost rank: its state comes from a peer."""
        return self.group is not None and self.group.joined_at is not None

    @property
    def group_size(self) -> int:
        """Ranks in the exchange now: the launch's, less those lost in a run that survives in place."""
        return self.group.group_size if self.group is not None else self.world_size

    @property
    def leads(self) -> bool:
        """This rank leads the run (evaluates, writes ``last.pt``, ``metrics.jsonl`` and the summary):
        rank 0, or in a run that survives in place the group's rank 0, its oldest member (rank 0 of
        the launch until it dies; then the oldest survivor, and so on)."""
        if self.group is not None:
            return self.group.group_rank == 0
        return self.rank == 0

    def rejoin_step(self) -> int | None:
        """Where a replacement starts; None: a fresh start or a resume."""
        return self.group.joined_at if self.joining else None

    def collective(self, phase: str) -> AbstractContextManager[None]:
        """Wrap blocking communication: a timeout becomes a ``CommTimeout`` naming the phase, the step
        and the ranks that never arrived (read from the run's progress board); in a run that survives
        in place, a ``PeerLost`` that :meth:`exchange` answers by regrouping."""
        if self.group is not None:
            return self.group.guard(phase, self.board.step if self.board is not None else None)
        return collective(phase, self.board)

    def exchange(self, fn: Callable[[], Any], step: int, again: Callable[[], Any] | None = None) -> Any:
        """``fn()``, an exchange whose collectives run under :meth:`collective`. In a run that survives
        in place, a lost peer makes the survivors regroup and repeat it (``again()``, where a first
        attempt already spent its input, as an in-place allreduce does). Returns ``CAUGHT_UP`` on a
        rank that the regroup found a step behind the others and that took a leader's state for this
        step (the rule's ``catch_up``): its own update of the step must not be applied."""
        self._exchanges += 1
        try:
            result = fn()
            if self._fault == step:  # PARAMBOX_FAULT lose-exchange: as a last send to a dead peer
                self._fault = None
                raise PeerLost(
                    f"step {step}: injected (lose-exchange), after the others finished the exchange"
                )
            return result
        except PeerLost:
            if self.group is None:
                raise
        while True:
            self.group.regroup(step)
            try:
                lag = self.group.lag
                if lag is not None:
                    self.rule.catch_up(lag.src, lag.behind, lag.why())
                    if lag.behind:
                        return CAUGHT_UP
                return (again or fn)()
            except PeerLost:
                continue

    def admit(self, step: int) -> None:
        """At the start of ``step`` (``--max-restarts``, ``workers = "MIN:MAX"``): replacements and
        workers that asked to join come in, and receive the model and the rule's state from group rank
        0 (the leader). Once a step: the loop calls it before it draws the step's batch (the batch is
        cut over the members), the rule's ``begin_step`` again (a user's own loop)."""
        if self.group is not None and step != self._admitted_at:
            self._admitted_at = step
            plan = self.group.admission(step, self.rule.next_exchange(step))
            if plan is not None:
                self.group.admit(plan)
                self.share_state()

    def share_state(
        self, src: int = 0, receive: bool | None = None, phase: str = "state to a replacement"
    ) -> None:
        """Group rank ``src``'s weights and resume state (optimizer, counters) to a replacement that
        joined (or, with ``receive``, to the ranks that say so)."""
        joins = self._awaits_state
        if receive is None:
            receive = joins
        self._awaits_state = False
        rule = self.rule
        mine = {
            "model": rule.model.state_dict(),
            "strategy": rule.state_dict(),
            "samples": [self._group_samples, self._pending_samples],
        }
        with self.collective(phase):
            state = broadcast_state(mine if self.group.group_rank == src else None, src)
        if receive:
            rule.load_model_state(state["model"])
            rule.load_state_dict(state["strategy"])
        if joins:  # the run's count so far: a replacement may come to lead (count_step)
            self._group_samples, self._pending_samples = state["samples"]

    def count_step(self, samples: int) -> None:
        """After each step, this rank's ``samples`` in it. A run that survives in place counts every
        member's: the steps since the last exchange once one has
        passed, times the members it had (a rank lost within a round of local steps, found out at
        the round's exchange, trained nothing the survivors kept); so a lost rank's samples count up
        to its death and a replacement's from its joining. Every member counts the same, so a
        survivor that comes to lead when the leader dies has the whole count."""
        if self.group is None:
            return
        self._pending_samples += samples
        if self._exchanges != self._counted:
            self._group_samples += self._pending_samples * self.group.group_size
            self._pending_samples, self._counted = 0, self._exchanges

    def group_samples(self) -> float | None:
        """Every member's samples (:meth:`count_step`), in a run that survives in place; else None."""
        if self.group is None:
            return None
        return self._group_samples + self._pending_samples * self.group.group_size
