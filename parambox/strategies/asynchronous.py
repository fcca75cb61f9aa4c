"""What every asynchronous strategy shares: the center weights in the box, and a worker's life around them.

Notation of the papers: ``x`` a worker's replica, ``c`` the center (global) weights in the box.

API (kept stable; the asynchronous strategies build on it)
-----------------------------------------------------------
:class:`AsyncOptions`
    ``termination`` (``all`` | ``fastest`` | ``average``, ShmCaffe's termination alignment) and
    ``lost_after_s``. A strategy's options subclass it.
:class:`~parambox.strategies.center.CounterMap`, :class:`~parambox.strategies.center.CenterClient`
    (``strategies/center.py``): where the box's counters are, and one worker's handle on the center
    ``c = box[start:start + numel]`` (``pull``, ``push`` refusing non-finite updates, the fused elastic
    exchange ``elastic_``, ``staleness``).
:func:`~parambox.strategies.grads.bind_flat_replica`
    ``x, g = bind_flat_replica(model, layout, device)``: parameters become views into the flat
    ``x``, their ``.grad`` views into ``g`` (also for strategies without a box, e.g. sync EASGD).
:class:`AsyncStrategy`
    A :class:`Strategy` whose replica is one flat buffer ``self.x`` (the parameters are views into
    it) with gradients in ``self.g`` (the ``.grad`` are views), so every exchange is one flat op.
    It opens the box (``c`` first, then ``extra_numel`` elements of the strategy's own at
    ``self.extra_start``), writes the initial weights into ``c``, and gives subclasses
    ``begin_step`` (zeroes ``g``), ``guard(loss, step)`` (halts a worker whose loss is non-finite),
    ``halt(what, step)`` and ``step_result(loss, samples)`` (counts the step, reports comm times,
    ``staleness`` and ``nonfinite``). Through its membership it aligns termination (``should_stop``) and
    waits for the others at the end, finding lost workers (``finish``; override ``flush`` to push
    what is left); it gives the result model (the center, on rank 0 or the worker that took over
    from a lost rank 0), resume state and
    ``summary_extra`` (``lost_workers``, ``nonfinite_workers``, ``worker_steps``).

Who is in the run (start, counted steps, status, termination alignment, lost peers) is
``strategies/membership.py``'s :class:`~parambox.strategies.membership.Membership`, over the box's
counters; this module is the replica and the center around the rules.

Replacements (``--max-restarts``): a new process of a dead rank attaches to the box, pulls the
center, and does the steps its predecessor had not counted (``rejoin_step``); meanwhile the others
never stop. Resume: every rank restores its own last checkpoint (they checkpoint at their own pace),
rank 0 puts its saved center back and bumps ``ready`` again.

Memory ranks (``rma``, ``box.memory_ranks``, default 1 here): the last ranks of the run hold the
box and train nothing; they serve until the leader has taken the final center, marking dead workers.

Rank 0 lost (``Membership.await_leader``): the others, done, wait for rank 0 to take the center; where
it is lost first, the first to claim its part takes the center and writes the result.

A subclass implements ``end_step`` (and ``begin_step`` where the rule acts before the forward
pass, calling ``super().begin_step(step)``); e.g. the asynchronous EASGD update::

    def end_step(self, loss, samples, step):
        if self.guard(loss, step):
            self.optimizer.step()
            if (step + 1) % tau == 0 and not self.client.elastic_(self.x, alpha):
                self.halt("elastic update", step)
        return self.step_result(loss, samples)
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from parambox.box import BoxConfig, Layout
from parambox.box.node_cache import adopted_box, open_center_box
from parambox.errors import CommTimeout, UserError, warn
from parambox.numerics import is_finite
from parambox.runtime.control import rejoining
from parambox.runtime.spawn import process_identity
from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value
from parambox.strategies.center import BROKEN, DONE, FINAL, NONFINITE, CenterClient, CounterMap
from parambox.strategies.grads import GradViews, bind_flat_replica
from parambox.strategies.membership import Membership, unplace

SALVAGED = "salvaged"  # in a rank's state: it outlived a lost box, kept for the rebuild (training/salvage.py)


class AsyncOptions(Options):
    termination: Literal["all", "fastest", "average"] = Field(
        "all", description="stop when every worker / the fastest / the average worker has done its steps"
    )
    lost_after_s: float | None = Field(
        None,
        gt=0,
        description="a worker whose step count stops moving this long is lost (default: --timeout)",
    )


class AsyncStrategy(Strategy):
    """Base of the asynchronous strategies (see the module docstring for its API and an example step).

    >>> Downpour(ctx, DownpourOptions(n_push=4)).step((x, y), step=0)  # doctest: +SKIP
    """

    Options = AsyncOptions
    copies_the_weights = True  # the center in the box
    tolerates_worker_loss = True
    tolerates_rank0_loss = True  # the center lives in the box; another worker takes the result
    takes_spare_ranks = True  # a worker is one replica against the box: a spare rank can take its place
    lockstep = False
    # No collective anywhere (the box is the only channel): a dead rank cannot block a rendezvous.
    needs_process_group = False
    box_name: ClassVar[str] = "center"
    # Across nodes with several workers a node, the center is cached in each node's shm box and one
    # exchange per node crosses the link (``box/node_cache.py``; ``box.two_level=false``: off).
    caches_center: ClassVar[bool] = True
    # A lost box is rebuilt from the workers' replicas (``training/salvage.py``): each holds a whole one.
    rebuilds_center: ClassVar[bool] = True
    # What rank 0's resume state holds of the box beyond the center (from the checkpoint, in a rebuild).
    box_state_keys: ClassVar[tuple[str, ...]] = ("box_extra",)

    @classmethod
    def memory_ranks(cls, box: BoxConfig, *, emulated_nodes: bool = False) -> int:
        """``box.memory_ranks`` where set; else, on the rma box, one memory rank for a strategy that
        survives a dead worker (a shard on a worker would die with it) unless the user placed the
        shards (``box_ranks``, ``num_shards``) or the nodes are emulated (a memory rank would be one
        process more than the nodes share evenly: the box is sharded over the workers there)."""
        if box.memory_ranks is not None or box.backend != "rma":
            return box.memory_ranks or 0
        placed = box.box_ranks is not None or box.num_shards is not None
        return int(cls.tolerates_worker_loss and not placed and not emulated_nodes)

    def __init__(self, ctx: Context, options: AsyncOptions, *, extra_numel: int = 0, extra_counters: int = 0):
        super().__init__(ctx, options)
        box_config = self._place_ranks(ctx.box)
        rank, n = self.world.rank, self.num_workers
        self.layout = Layout.from_model(self.model)
        self.numel = self.layout.numel
        self.params = list(self.model.parameters())
        self.result: nn.Module | None = None  # the leader's: a model bound to its own copy of the center
        if rank == 0:
            self._make_result()
        self.x, self.g = bind_flat_replica(self.model, self.layout, ctx.world.device)
        self.grad_views = GradViews.of_flat(self.model, self.layout, self.g)
        self.counters = CounterMap(n, extra_counters, self.spare_ranks)
        self.extra_start, self.extra_numel = self.numel, extra_numel
        self.box = adopted_box(self.box_name) or open_center_box(
            box_config,
            self.world,
            self.numel + extra_numel,
            self.counters.num_counters,
            self.box_name,
            cached=self.numel if self.caches_center else 0,
            pushes=not self.serves,
            layout_hash=self.layout.fingerprint(),
            timeout=ctx.timeout_s,
        )
        self.client = CenterClient(self.box, self.numel, timers=self.timers)
        if self.spare is not None:  # its identity, which the memory rank hands on with the worker's place
            self.box.set_counter(self.counters.spare_ident(self.spare), process_identity())
        self.rejoined = rejoining() and not self.serves  # a replacement of a dead worker
        self.halted = False
        self.rebuilt: dict[str, Any] | None = None  # a lost box rebuilt from replicas (training/salvage.py)
        self._final = False
        self._leads = rank == 0  # rank 0, or the worker that took over its part at the end (finish)
        # Who is in the run (start, counted steps, status, termination, lost peers): the box's counters.
        self.membership = Membership(
            self.box,
            self.counters,
            rank,
            n,
            ctx.steps,
            options.termination,
            options.lost_after_s or ctx.timeout_s,
            spares=self.spare_ranks,
        )
        if not self.serves:
            self._join()

    def _make_result(self) -> None:
        self.result = copy.deepcopy(self.model)
        self.result_x = torch.empty(self.numel, device=self.world.device)
        self.layout.bind_params_(self.result, self.result_x)

    @property
    def leads(self) -> bool:
        """Rank 0; or, once rank 0 was lost before the end, the worker that claimed its part."""
        return self._leads and not self.serves

    def _place_ranks(self, box: BoxConfig) -> BoxConfig:
        """The box config with its memory ranks decided; which ranks train (``num_workers``), which serve."""
        if box.backend == "rma" and box.memory_ranks is None:  # in process; a launched run's plan decided
            box = box.model_copy(update={"memory_ranks": self.memory_ranks(box)})
        self.memory_ranks = box.memory_ranks or 0
        if self.memory_ranks and not self.tolerates_worker_loss:
            raise UserError(f"box.memory_ranks serves asynchronous strategies, not {self.name!r}")
        self.spare_ranks = box.spare_ranks or 0
        if self.spare_ranks and not self.memory_ranks:
            raise UserError(
                "box.spare_ranks needs box.memory_ranks >= 1: a worker that holds part of the box takes "
                "it with it, and no spare can bring it back"
            )
        self.num_workers = self.world.world_size - self.memory_ranks - self.spare_ranks
        if self.num_workers < 1:
            raise UserError(
                f"box.memory_ranks={self.memory_ranks} and box.spare_ranks={self.spare_ranks} leave none "
                f"of the {self.world.world_size} ranks to train"
            )
        # A memory rank holds the box and trains nothing; so does a spare rank (``spare``: its index)
        # until the memory rank gives it a dead worker's place (``await_place``).
        self.serves = self.world.rank >= self.num_workers
        index = self.world.rank - self.num_workers
        self.spare = index if 0 <= index < self.spare_ranks else None
        return box

    def _join(self) -> None:
        """Rank 0 puts the initial center in the box (unless a previous life of it did), the others
        wait for that alone; a replacement then starts from the center."""
        self.membership.join(lambda: self.box.write(self.x))  # every rank starts from the same weights
        if self.rejoined:
            if self.ctx.resuming and self.membership.resumed():  # (else it restores: resume waits)
                self.membership.await_ready(2)  # the saved center, not the initial one
            self.client.pull(self.x)
            self.membership.reached = self.membership.steps_done >= self.ctx.steps
            # a replacement of a rank 0 that another worker took for lost, and whose result it took
            self.halted = self.world.rank == 0 and self.membership.result_taken()

    def await_place(self) -> tuple[int, int] | None:
        """A spare rank: until the memory rank gives it a dead worker's place (that worker's rank, and
        the life of it the spare starts: 1 for its first replacement), or the run ends without needing
        it (None). Where every memory rank died (on one host the box outlives them), the first spare
        still waiting keeps the book of places in their stead until the run ends (then None)."""
        m, box, index, members = self.counters, self.box, self.spare, self.membership
        memory = range(self.num_workers + self.spare_ranks, self.world.world_size)
        while True:
            if value := box.read_counter(m.assign(index)):
                return unplace(value)
            if members.run_over():
                return None
            if members.spare_keeps_places(box.failed_ranks(), memory):
                warn(f"every memory rank died; spare rank {self.world.rank} keeps the book of places")
                self._serve()
                return None
            time.sleep(0.01)

    def _serve(self) -> None:
        """Serve the box and keep the book until the run's end (a memory rank; a spare where every
        memory rank died). Past twice the longest a worker may legitimately stand still (a leader waits
        lost_after_s for a stalled peer) it gives up: the launcher's watch on mpiexec uses the same bound."""
        members = self.membership
        members.serve(deadline_s=2 * max(self.ctx.timeout_s, members.lost_after_s))

    def data_partition(self) -> tuple[int, int]:
        # Memory ranks read no data; they get a valid shard all the same.
        return min(self.world.rank, self.num_workers - 1), self.num_workers

    def rejoin_step(self) -> int | None:
        """A replacement's first step: the dead worker's count in the box (its steps are not redone).
        None (it restores its checkpoint) in a resumed run whose predecessor died before it had
        resumed: before its steps were counted again, or, rank 0, before it put the saved center back
        (the box still holds the initial weights)."""
        if not self.rejoined or (self.ctx.resuming and not self.membership.resumed()):
            return None
        return self.box.read_counter(self.counters.steps(self.world.rank))

    # -- the step ------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Zero ``g`` in place: backward accumulates the step's gradient into it (the ``.grad`` views,
        bound again where a user's ``zero_grad(set_to_none=True)`` dropped them)."""
        self.g.zero_()
        self.grad_views.rebind_()

    def settle_grads(self) -> None:
        self.grad_views.settle_()

    def guard(self, loss: torch.Tensor | None, step: int) -> bool:
        """False (and the worker halts) when the loss is not finite: nothing of this step is pushed.
        An unknown loss (None) passes: every push refuses a non-finite update anyway."""
        if loss is None or is_finite(loss):
            return True
        self.halt("loss", step)
        return False

    def halt(self, what: str, step: int) -> None:
        """This worker's loss or update became non-finite: it stops pushing and leaves the run."""
        if self.halted:
            return
        self.halted = True
        self.membership.set_status(self.world.rank, NONFINITE)
        warn(f"rank {self.world.rank}: non-finite {what} at step {step}; it stops pushing and leaves the run")

    def step_result(self, loss: torch.Tensor | None, samples: int) -> StepResult:
        """Count the step in the box (:meth:`Membership.count_step`: heartbeat, termination, the run's
        samples) and report comm times and staleness."""
        with self.timers.phase("count"):
            self.membership.count_step(samples)
        extra = {"staleness": float(self.client.staleness)}
        if self.halted:
            extra["nonfinite"] = 1.0
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def flush(self) -> None:
        """Called once after the last step, before the worker says it is done: push what is left."""

    # -- termination alignment -------------------------------------------------------------------------
    def should_stop(self, step: int) -> bool:
        if self.halted or self.serves:
            return True
        return self.membership.should_stop(step)

    def finish(self) -> None:
        """Push what is left, say DONE; rank 0 waits for the others (or finds them lost) and takes the
        center; the others wait for that, and where rank 0 is lost first one of them takes its part
        (:meth:`Membership.await_leader`); a memory rank serves until then."""
        rank, members = self.world.rank, self.membership
        if self.spare is not None:  # a spare the run never needed (await_place said so)
            return
        if self.serves:
            self._serve()
            return
        members.settle()  # every step counted before DONE says so
        if not self.halted:
            self.flush()
        self.box.sync_levels()  # a node's last update reaches the cross-node box before DONE says so
        members.set_status(rank, DONE)
        self._leads = members.claim_lead() if rank == 0 else members.await_leader()
        if self._leads:
            if self.result is None:
                self._make_result()
            members.await_peers()
            self.box.sync_levels()  # and rank 0's node takes the center every node's updates made
            self.box.pull(self.result_x)
            self._final = True
            if members.lost or self.box.failed_ranks():  # a rank died: the process group is broken
                members.set_status(0, BROKEN)
            members.set_status(0, FINAL)
        elif not self.box.outlives_processes:
            members.await_final()  # the box's shards live on the workers: keep ours until rank 0 has read c
        self.timers.pop()

    # -- results, checkpoints, summary ------------------------------------------------------------------
    def result_from_box(self) -> bool:
        """After ``finish``: True where the leader found a rank of the run dead (``BROKEN``), and then
        this rank's replica is the center, read from the box (the leader's result holds it already)."""
        if self.spare is not None or not self.box.read_counter(self.counters.status(0)) & BROKEN:
            return False
        if not self.leads:
            self.client.pull(self.x)
        return True

    def eval_model(self) -> nn.Module | None:
        """The leader: a model holding the center weights (the run's result); None elsewhere."""
        if self.result is None or not self.leads:
            return None
        if not self._final:
            self.box.pull(self.result_x)
        with torch.no_grad():  # buffers (batch-norm statistics) are not in the box: rank 0's own
            for dst, src in zip(self.result.buffers(), self.model.buffers()):
                dst.copy_(src)
        return self.result

    def state_dict(self) -> dict[str, Any]:
        if self.serves:
            return {}
        state = super().state_dict()
        self.membership.settle()
        state["steps_done"] = self.membership.steps_done
        state["box"] = self.membership.born  # (a rebuild takes replicas of this box or a later one)
        if self.leads:
            state["center"] = self.box.pull(torch.empty(self.numel)).clone()
            if self.extra_numel:  # the strategy's own state in the box (Adagrad's sums, diloco's momentum)
                state["box_extra"] = self.box.pull(torch.empty(self.extra_numel), self.extra_start).clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (every rank from its own last checkpoint): counters carry on and rank 0 puts the
        saved center back in the box; nobody pulls before it is back."""
        super().load_state_dict(state)
        if self.serves:
            return

        def put_back() -> None:
            if "center" in state:
                self.box.write(state["center"])
            if "box_extra" in state and self.extra_numel:
                self.box.write(state["box_extra"], self.extra_start)

        self.membership.resume(int(state.get("steps_done", 0)), put_back)
        if state.get(SALVAGED):  # its replica went into the rebuilt center: start from that
            self.client.pull(self.x)
            self.restart_from_center()

    # -- a lost box, rebuilt (training/salvage.py) --------------------------------------------------------
    def salvage_state(self, step: int) -> dict[str, Any]:
        """What a worker keeps when the box is lost: its optimizer, its count of steps and which box it
        outlived (no box op)."""
        return {**Strategy.state_dict(self), "steps_done": step, "box": self.membership.born, SALVAGED: True}

    def rebuilt_center(self, replicas: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The mean of the workers' replicas (their model state_dicts), as the flat center."""
        if self.result is None:
            self._make_result()
        total = torch.zeros(self.numel)
        for replica in replicas:
            self.result.load_state_dict(replica)
            total += self.result_x.cpu()
        return total / len(replicas)

    def restart_from_center(self) -> None:
        """After ``x`` took the rebuilt center: what this rule keeps of its last exchange starts afresh
        there, as a replacement's does (nothing owed to the center, which holds this replica's share)."""

    def total_samples(self, local: int) -> float:
        """Every worker's samples, counted in the box (also those of lost and replaced workers)."""
        return float(self.box.read_counter(self.counters.samples))

    def wall_time(self, local: float) -> float:
        """From the moment the center went into the box (this life's start: the others train from
        then on, also while rank 0 still sets up, and a replacement of rank 0 came later still)."""
        return max(local, time.time() - self.box.read_counter(self.counters.started) / 1e6)

    def summary_extra(self) -> dict[str, Any]:
        """The leader: the workers lost or halted on non-finite values, and every worker's step count."""
        extra = self.membership.summary()
        if self.memory_ranks:
            extra["memory_ranks"] = self.memory_ranks
        if self.rebuilt is not None:  # this life's center: the replicas' mean (training/salvage.py)
            extra["rebuilt_box"] = self.rebuilt
        return extra

    def close(self) -> None:
        for p in self.params:
            p.grad = None
        with contextlib.suppress(CommTimeout):  # a failed run: its last counts matter to nobody
            self.membership.settle()
        self.box.close()
