"""``sandblaster``: DistBelief's batch method, distributed L-BFGS driven by a coordinator.

Every rank holds the batch (in DistBelief the data lives with the workers); what travels is
small commands, weights and gradients. For each evaluation of the objective the coordinator
(rank 0) cuts the batch into ``num_portions`` portions, more than there are workers, and hands
them one at a time to whichever worker is free, so fast workers take more. When no fresh portion
is left, a worker that falls idle gets a copy of a portion still running elsewhere (a *backup
task*) and the first result wins: one slow machine does not hold the batch up. The coordinator
sums the gradients, adds the weight-decay term and runs L-BFGS (``lbfgs.py``: two-loop recursion,
Armijo line search or none); a line search may evaluate several points per step. By default the
coordinator also computes portions between dispatches: on a small machine every core counts.

The dispatch policy is ``portions.py``, the coordinator's messaging ``farm.py``; this module holds
the L-BFGS step and the workers' side. ``--set sandblaster.slow_worker=RANK:FACTOR`` makes one worker
take FACTOR times as long per portion (it sleeps), to show the backups at work.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, field_validator
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from parambox.errors import UserError
from parambox.strategies.base import Context, Options, StepResult, Strategy, batch_size, map_tensors
from parambox.strategies.sandblaster.farm import BYE, END_STEP, HEADER, RESULT, TASK, WEIGHTS, PortionFarm
from parambox.strategies.sandblaster.lbfgs import LBFGSHistory, LineSearch, lbfgs_iteration
from parambox.strategies.sandblaster.portions import compute_portion, portion_bounds


def parse_slow_worker(spec: str) -> tuple[int, float]:
    """``"1:5"`` -> ``(1, 5.0)``."""
    try:
        rank, factor = spec.split(":")
        parsed = int(rank), float(factor)
    except ValueError:
        raise ValueError(f"slow_worker {spec!r}: expected RANK:FACTOR, e.g. 1:5") from None
    if parsed[0] < 0 or parsed[1] < 1:
        raise ValueError(f"slow_worker {spec!r}: need RANK >= 0 and FACTOR >= 1")
    return parsed


class SandblasterOptions(Options):
    num_portions: int = Field(16, ge=1, description="portions per batch; more than workers balances load")
    line_search: Literal["armijo", "none"] = "armijo"
    max_evals: int = Field(10, ge=1, description="most evaluations per step in the line search")
    history_size: int = Field(10, ge=1, description="L-BFGS curvature pairs kept")
    lr: float = Field(1.0, gt=0, description="L-BFGS step length (--lr, --momentum are not used)")
    backup: bool = Field(True, description="near a batch's end, copy running portions to idle workers")
    coordinator_computes: bool = Field(True, description="rank 0 computes portions too")
    slow_worker: str | None = Field(
        None, description="RANK:FACTOR, a test/demo: that rank is FACTOR x slower"
    )

    @field_validator("slow_worker")
    @classmethod
    def _valid_slow_worker(cls, v: str | None) -> str | None:
        if v is not None:
            parse_slow_worker(str(v))
        return v


class Sandblaster(Strategy):
    """Distributed batch L-BFGS; rank 0 coordinates.

    >>> # parambox train --strategy sandblaster --workers 2 --model logreg --batch-size 1438 \\
    >>> #     --steps 60 --weight-decay 1e-3 --set sandblaster.slow_worker=1:5
    """

    name = "sandblaster"
    owns_forward_backward = True  # portions of the batch are computed where the coordinator sends them
    Options = SandblasterOptions

    def __init__(self, ctx: Context, options: SandblasterOptions):
        super().__init__(ctx, options)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.slow_rank, self.slow_factor = (-1, 1.0)
        if options.slow_worker:
            self.slow_rank, self.slow_factor = parse_slow_worker(options.slow_worker)
            if self.slow_rank >= self.world.world_size:
                raise UserError(f"slow_worker {options.slow_worker!r}: there is no rank {self.slow_rank}")
        if not options.coordinator_computes and self.world.world_size == 1:
            raise UserError("sandblaster.coordinator_computes=false needs at least one more worker")
        self.weight_decay = self._optimizer_setting(ctx, "weight_decay", 0.0)
        # Messages are CPU tensors over gloo, also in a GPU run: nccl cannot receive from any rank.
        self.group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        self.farm: PortionFarm | None = None
        if self.world.rank == 0:
            self._init_coordinator()

    @staticmethod
    def _optimizer_setting(ctx: Context, key: str, default: float) -> float:
        # The run's optimizer settings reach strategies only through the factory: build one on a
        # dummy parameter and read them back (L-BFGS is the optimizer here).
        probe = ctx.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
        return float(probe.defaults.get(key, default))

    def data_partition(self) -> tuple[int, int]:
        return 0, 1  # every rank holds the whole batch; the coordinator hands out portions of it

    def _my_slow_factor(self) -> float:
        return self.slow_factor if self.world.rank == self.slow_rank else 1.0

    # -- the step -------------------------------------------------------------------------------
    def step(self, batch: Any, step: int) -> StepResult:
        bounds = portion_bounds(batch_size(batch), self.options.num_portions)
        if self.world.rank == 0:
            return self._coordinate(batch, bounds)
        return self._serve(batch, bounds)

    def _serve(self, batch: Any, bounds: list[tuple[int, int]]) -> StepResult:
        """A worker: compute the portions the coordinator sends until it ends the step."""
        task, computed, busy = torch.empty(4, dtype=torch.float64), 0, 0.0
        weights = torch.empty(self.numel)
        while True:
            with self.timers.phase("wait_task"), self.collective("sandblaster task"):
                dist.recv(task, src=0, tag=TASK, group=self.group)
            kind, eval_id, portion, flag = task.tolist()
            if kind == END_STEP:
                extra = {"portions_computed": float(computed), "compute_s": busy}
                return StepResult(flag, 0, self.timers.pop(), extra)
            if flag:  # the weights of this evaluation follow
                with self.timers.phase("weights"), self.collective("sandblaster weights"):
                    dist.recv(weights, src=0, tag=WEIGHTS, group=self.group)
                vector_to_parameters(weights.to(self.params[0].device), self.params)
            out = compute_portion(
                self.model, self.ctx.loss_fn, batch, bounds[int(portion)], self._my_slow_factor()
            )
            computed, busy = computed + 1, busy + float(out[2])
            with self.timers.phase("send_result"), self.collective("sandblaster result"):
                dist.send(
                    torch.cat([torch.tensor([eval_id, portion]), out]), dst=0, tag=RESULT, group=self.group
                )

    def finish(self) -> None:
        if self.world.rank == 0:
            with self.collective("sandblaster shutdown"):
                self.farm.close()
        else:  # tells the coordinator's receiving thread that this rank sends nothing more
            bye = torch.zeros(HEADER + 3 + self.numel)
            bye[0] = BYE
            with self.collective("sandblaster bye"):
                dist.send(bye, dst=0, tag=RESULT, group=self.group)

    def summary_extra(self) -> dict[str, Any]:
        if self.farm is None:
            return {}
        per_rank = self.farm.mean_portion_seconds()
        return {f"sandblaster_{k}": v for k, v in self.totals.items()} | {
            "sandblaster_portion_s": {str(r): s for r, s in per_rank.items()}
        }

    def close(self) -> None:
        if self.farm is not None and self.farm.local is not None:
            self.farm.local.close(timeout_s=1.0)

    # -- the coordinator ------------------------------------------------------------------------
    def _init_coordinator(self) -> None:
        opts = self.options
        self.history = LBFGSHistory(opts.history_size)
        self.line_search = LineSearch(opts.line_search, max_evals=opts.max_evals)
        self.iteration = 0
        self.f: float | None = None
        self.g: torch.Tensor | None = None
        self.data_loss = self.last_data_loss = float("nan")
        self.batch_key: list[float] | None = None
        # Over the run, for summary.json; bytes_to_coordinator: message bytes rank 0 received.
        self.totals = {"evals": 0, "backups": 0, "backup_wins": 0, "bytes_to_coordinator": 0}
        remote = list(range(1, self.world.world_size))
        self.farm = PortionFarm(remote, self.numel, self.ctx.timeout_s, opts.backup, self.group)
        if opts.coordinator_computes:
            self.farm.add_local(self.model, self.ctx.loss_fn, self._my_slow_factor())

    def _coordinate(self, batch: Any, bounds: list[tuple[int, int]]) -> StepResult:
        self.batch, self.step_stats = (
            (batch, bounds),
            {"evals": 0.0, "batch_s": 0.0, "backups": 0.0, "backup_wins": 0.0},
        )
        bytes0 = self.farm.bytes_in
        w = parameters_to_vector(self.params).detach().clone()
        key = _fingerprint(batch)
        if self.f is None or self.batch_key is None or not _same(key, self.batch_key):
            self.f, self.g = self._evaluate(w)  # a new batch: f and g at w on it
            self.data_loss = self.last_data_loss
        self.batch_key = key
        loss, objective = self.data_loss, self.f
        w, self.f, self.g, t, _ = lbfgs_iteration(
            self._evaluate, w, self.f, self.g, self.history,
            lr=self.options.lr, first=self.iteration == 0, line_search=self.line_search,
        )  # fmt: skip
        if t > 0:  # the last point evaluated is the one accepted
            self.data_loss = self.last_data_loss
        vector_to_parameters(w, self.params)
        self.iteration += 1
        self.farm.end_step(loss)
        stats = self.step_stats
        for k in ("evals", "backups", "backup_wins"):
            self.totals[k] += int(stats[k])
        self.totals["bytes_to_coordinator"] += self.farm.bytes_in - bytes0
        extra = {"objective": objective, "step_size": t, **stats}
        extra["bytes_to_coordinator"] = float(self.farm.bytes_in - bytes0)
        extra["batch_s"] = stats["batch_s"] / max(stats["evals"], 1.0)
        extra.update({f"portion_s_rank{r}": s for r, s in self.farm.mean_portion_seconds().items()})
        return StepResult(loss, batch_size(batch), self.timers.pop(), extra)

    def _evaluate(self, w: torch.Tensor) -> tuple[float, torch.Tensor]:
        """The objective (mean loss + weight decay) and its gradient at ``w``: one farmed-out pass."""
        ev = self.farm.evaluate(w.detach().to("cpu", copy=True), self.batch)  # must not change: sent
        stats = self.step_stats
        stats["evals"] += 1
        stats["batch_s"] += ev.seconds
        stats["backups"] += ev.backups
        stats["backup_wins"] += ev.backup_wins
        self.last_data_loss = ev.loss_sum / ev.samples
        g = (ev.grad_sum / ev.samples).to(w.dtype).to(w.device) + self.weight_decay * w
        return self.last_data_loss + 0.5 * self.weight_decay * float(w.dot(w)), g

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.world.rank != 0:
            return {}
        return {
            "history": self.history.state_dict(),
            "iteration": self.iteration,
            "f": self.f,
            "g": self.g,
            "data_loss": self.data_loss,
            "batch_key": self.batch_key,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.world.rank != 0 or not state:
            return
        self.history.load_state_dict(state["history"])
        self.iteration = int(state["iteration"])
        self.f, self.g, self.data_loss = state["f"], state["g"], float(state["data_loss"])
        self.batch_key = state["batch_key"]


def _fingerprint(batch: Any) -> list[float]:
    """Order-free sums of a batch: full-batch runs see the same set each step (reshuffled), and then
    ``f, g`` at the current weights carry over instead of being evaluated again."""
    key = [float(batch_size(batch))]
    map_tensors(lambda t: key.extend([float(t.double().sum()), float(t.double().square().sum())]), batch)
    return key


def _same(a: list[float], b: list[float]) -> bool:
    return all(abs(u - v) <= 1e-9 * max(1.0, abs(u), abs(v)) for u, v in zip(a, b))
