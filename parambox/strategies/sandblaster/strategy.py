"""``sandblaster``: DistBelief's batch method, distributed L-BFGS driven by a coordinator.

Every rank holds the batch (in DistBelief the data lives with the workers). For each evaluation of
the objective the coordinator (rank 0) cuts the batch into ``num_portions`` portions, more than
there are workers, and hands them one at a time to whichever worker is free, so fast workers take
more. When no fresh portion is left, a worker that falls idle gets a copy of a portion still running
elsewhere (a *backup task*) and the first result wins: one slow machine does not hold the batch up.
Workers compute on a thread (``worker.py``), so a slow worker's copy in flight holds up neither the
collectives that follow nor the next evaluation: it is stopped once its evaluation is over.

The vectors live on the shards, and only scalars travel to the coordinator (DistBelief's central
point). The shard holders are the computing workers: ranks 1.. by default, rank 0 too with
``coordinator_computes=true`` (or when it is alone); holder ``k`` keeps shard ``k`` of the iterate,
the gradient, the direction and the L-BFGS history (``shards.py``). The coordinator runs L-BFGS
(vector-free two-loop recursion, Armijo line search or none) as a sequence of vector operations it
sends to the holders (``axpby``, ``lincomb``; ``reduce``, a block of dot products answered by one
message of scalars per holder, twice per iteration without a line search). An evaluation:
the holders all-gather the point to evaluate (every worker needs the whole model to compute a
portion); portions go out and come back as ``[loss sum, samples, seconds]``; then the coordinator
tells each worker which of its portions won, the workers all-reduce the winners' gradient sums among
themselves, and each holder keeps its shard, scaled and with the weight-decay term added.
``bytes_to_coordinator`` (per step in metrics.jsonl, over the run in summary.json) counts every
byte rank 0 receives in training, collectives included: by default results and operation replies, a
few dozen bytes per portion and operation, whatever the model's size; with
``coordinator_computes=true`` also its share of the holders' all-gathers and all-reduces. The
iterate gathered to rank 0 for the test set counts apart (``bytes_to_rank0_for_eval``).

The dispatch policy is ``portions.py``, the coordinator's messaging ``farm.py``, the workers'
compute thread ``worker.py``, the sharded L-BFGS ``shards.py``; this module holds the L-BFGS step
and the workers' side. ``--set sandblaster.slow_worker=RANK:FACTOR`` makes one worker take FACTOR
times as long per portion (it computes the portion's gradient again), to show the backups at work. Per step, ``portion_phase_s``
(the evaluations' portion phases) and ``step_s`` (the whole step at the coordinator) show what the
backups save.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, field_validator
from torch.nn.utils import vector_to_parameters

from parambox.box.layout import shard_range
from parambox.errors import CommTimeout, UserError
from parambox.strategies.base import Context, Options, StepResult, Strategy
from parambox.strategies.sandblaster.farm import (
    BYE,
    COMPUTE,
    END_STEP,
    FRAMES,
    REPLY,
    RESULT,
    RESULT_LEN,
    TASK,
    TASK_FIELDS,
    PortionFarm,
    task_message_len,
)
from parambox.strategies.sandblaster.holders import AXPBY, GATHER, LINCOMB, REDUCE, HolderOps, payload_width
from parambox.strategies.sandblaster.lbfgs import LineSearch
from parambox.strategies.sandblaster.portions import portion_bounds
from parambox.strategies.sandblaster.shards import (
    Gram,
    ShardedHistory,
    ShardStore,
    W,
    num_slots,
    sharded_lbfgs_iteration,
)
from parambox.strategies.sandblaster.worker import PortionGrads, PortionWorker
from parambox.strategies.tensors import batch_size, flatten, map_tensors


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
    coordinator_computes: bool | None = Field(
        None,
        description="rank 0 computes portions too (then weights and gradients reach it); "
        "default: only when it is the only rank",
    )
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
    resizes = False  # the iterate and L-BFGS history are sharded over the run's ranks
    owns_forward_backward = True  # portions of the batch are computed where the coordinator sends them
    Options = SandblasterOptions
    # A batch method: L-BFGS's curvature pairs need the same objective from step to step, so the batch
    # is the whole training set of the default data (DistBelief: the whole data set; digits: 1,438). At
    # the run's batch 32 the default digits run stayed at chance (0.10); at batch 1024 for 150 steps,
    # 5 of seeds 0-9 ended at 0.925-0.9499, the training loss at 1e-6 (overfitted): the weight decay
    # 1e-3 and the whole set brought seeds 0-9 to 0.953-0.972. The vector-free recursion rounds
    # differently: at 150 steps seed 1 ended at 0.947, still rising; at 200, seeds 0-9 0.955-0.978.
    default_run = {"batch_size": 1438, "weight_decay": 1e-3, "steps": 200, "eval_every": 50}
    # On a data set of sequences the whole set is no batch (text: 30,000 and more windows of 128 bytes;
    # 1,438 of them took 29 s a step with the zoo's gpt, two evaluations a step, only rank 1
    # computing): the default run's global batch of 64 windows, 1.75 s a step, reached test perplexity
    # 20.7, 17.2, 16.4, 15.1 at steps 50-200 (the target, the bytes' own frequencies: 26.3); 300
    # steps fit bench defaults' 10 minutes a run.
    default_run_sequence = {"batch_size": 64, "steps": 300}

    def __init__(self, ctx: Context, options: SandblasterOptions):
        super().__init__(ctx, options)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.slow_rank, self.slow_factor = (-1, 1.0)
        if options.slow_worker:
            self.slow_rank, self.slow_factor = parse_slow_worker(options.slow_worker)
            if self.slow_rank >= self.world.world_size:
                raise UserError(f"slow_worker {options.slow_worker!r}: there is no rank {self.slow_rank}")
        if options.coordinator_computes is False and self.world.world_size == 1:
            raise UserError("sandblaster.coordinator_computes=false needs at least one more worker")
        # By default rank 0 only coordinates (DistBelief's point: it receives scalars alone), unless
        # no one else could compute.
        self.computes_at_0 = options.coordinator_computes is True or self.world.world_size == 1
        self.weight_decay = self._optimizer_setting(ctx, "weight_decay", 0.0)
        # Messages are CPU tensors over gloo, also in a GPU run: nccl cannot receive from any rank.
        self.group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        n = self.world.world_size
        self.holders = list(range(n)) if self.computes_at_0 else list(range(1, n))
        self.hgroup = self.group
        if len(self.holders) < n:  # the coordinator holds no shard: the workers' own group
            self.hgroup = dist.new_group(self.holders, backend="gloo")
        self.bounds = [shard_range(self.numel, k, len(self.holders)) for k in range(len(self.holders))]
        self.payload = payload_width(options.num_portions, options.history_size)
        self.store: ShardStore | None = None
        if self.world.rank in self.holders:
            start, stop = self.bounds[self.holders.index(self.world.rank)]
            self.store = ShardStore(start, stop, num_slots(options.history_size))
            self.store.v[W].copy_(flatten(self.params).detach().cpu()[start:stop])
        # Bytes this rank received in collectives (rank 0's count as the coordinator's), and in the
        # all-gathers that bring the iterate to rank 0 for the test set.
        self.collective_bytes_in, self.eval_bytes_in = 0, 0
        self.worker: PortionWorker | None = None  # a remote worker's compute thread
        self.weights: torch.Tensor | None = None  # the last evaluation's point, all-gathered
        self.weights_sent: torch.Tensor | None = None  # the point the compute thread has
        self.done = (0, 0.0)  # portions computed, seconds busy, at the last step's end
        if self.world.rank != 0:
            self.worker = PortionWorker(
                self.model, ctx.loss_fn, self._send_result, self._my_slow_factor(), replicate=False
            )
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
        """A worker: hand portions to the compute thread and run the vector operations the coordinator
        sends, in order, until it ends the step (the thread's portion in flight never holds this up)."""
        msg = torch.empty(task_message_len(self.payload), dtype=torch.float64)
        worker = self.worker
        while True:
            with self.timers.phase("wait_task"), self.collective("sandblaster task"):
                dist.recv(msg, src=0, tag=TASK, group=self.group)
            for task in msg[1:].view(FRAMES, -1)[: int(msg[0])]:
                if worker.error is not None:
                    raise worker.error
                kind, eval_id, portion, *args = task[:TASK_FIELDS].tolist()
                if kind == END_STEP:  # the last task of its message
                    computed, busy = worker.computed - self.done[0], worker.busy_s - self.done[1]
                    self.done = (worker.computed, worker.busy_s)
                    extra = {"portions_computed": float(computed), "compute_s": busy}
                    return StepResult(args[0], 0, self.timers.pop(), extra)
                if kind != COMPUTE:
                    self._vector_op(kind, int(eval_id), int(portion), args, task[TASK_FIELDS:])
                    continue
                fresh = self.weights is not self.weights_sent
                worker.submit(int(eval_id), int(portion), self.weights if fresh else None, (batch, bounds))
                self.weights_sent = self.weights

    def _send_result(self, out: torch.Tensor) -> None:
        """On the compute thread: one portion's scalars to the coordinator."""
        with self.collective("sandblaster result"):
            dist.send(out, dst=0, tag=RESULT, group=self.group)

    def _vector_op(self, kind: float, eval_id: int, op: int, args: list[float], flags: torch.Tensor) -> None:
        """One operation on this holder's shards (a worker; the coordinator calls the parts itself)."""
        store = self.store
        if kind == GATHER:
            with self.timers.phase("gather"):
                self.weights = self.all_gather(int(args[0]))
        elif kind == REDUCE:  # the evaluation is over: a copy still running is of no use
            self.worker.cancel_through(eval_id)
            won = [p for p, f in enumerate(flags.tolist()) if f]
            with self.timers.phase("reduce"):
                self.reduce(self.worker.grads, eval_id, won, int(args[0]), int(args[1]), args[2], args[3])
        elif kind == AXPBY:
            c, alpha, a, beta, b = args
            store.axpby(int(c), alpha, int(a), beta, int(b))
        elif kind == LINCOMB:
            c, n = int(args[0]), int(args[1])
            values = flags.tolist()
            store.lincomb(c, dict(zip((int(v) for v in values[:n]), values[n : 2 * n])))
        else:  # REDUCTION
            n_rows, n_cols, amax, asum = (int(a) for a in args[:4])
            slots = [int(v) for v in flags[: n_rows + n_cols].tolist()]
            value = store.reduce(slots[:n_rows], slots[n_rows:], amax, asum)
            with self.collective("sandblaster reply"):
                dist.send(value, dst=0, tag=REPLY, group=self.group)

    # -- collectives among the shard holders ---------------------------------------------------------
    def all_gather(self, slot: int, everyone: bool = False) -> torch.Tensor:
        """The whole vector in ``slot`` from the holders' shards (collective over the holders, or with
        ``everyone`` over every rank, where a rank that holds no shard contributes nothing)."""
        sizes = [b - a for a, b in self.bounds]
        width = max(sizes)
        mine = torch.zeros(width)
        if self.store is not None:
            mine[: self.store.v.shape[1]] = self.store.v[slot]
        members = list(range(self.world.world_size)) if everyone else self.holders
        if len(members) == 1:
            parts = [mine]
        else:
            parts = [torch.empty(width) for _ in members]
            with self.collective("sandblaster all-gather"):
                dist.all_gather(parts, mine, group=self.group if everyone else self.hgroup)
            self.collective_bytes_in += (len(members) - 1) * mine.numel() * mine.element_size()
        by_rank = dict(zip(members, parts))
        return torch.cat([by_rank[r][:n] for r, n in zip(self.holders, sizes)])

    def reduce(
        self, grads: PortionGrads, eval_id: int, won: list[int], dst: int, src: int, samples: float, wd: float
    ) -> None:
        """Shard of ``dst`` := (the sum of every worker's winning portion gradients) / samples + wd * ``src``:
        the winners' sums are all-reduced among the holders, each keeps its shard."""
        total = grads.take_sum(eval_id, won, self.numel)
        if len(self.holders) > 1:
            with self.collective("sandblaster gradient all-reduce"):
                dist.all_reduce(total, group=self.hgroup)
            n = len(self.holders)  # what a ring all-reduce brings each member: 2 (n - 1) / n of it
            self.collective_bytes_in += 2 * (n - 1) * total.numel() * total.element_size() // n
        store = self.store
        mean = (total[store.start : store.stop] / samples).float()
        store.v[dst].copy_(mean + wd * store.v[src])

    def finish(self) -> None:
        if self.world.rank == 0:
            with self.collective("sandblaster shutdown"):
                self.farm.close()
        else:  # tells the coordinator's receiving thread that this rank sends nothing more
            self.worker.cancel_through(self.worker.last_over)
            if not self.worker.close(self.ctx.timeout_s):
                raise CommTimeout(f"sandblaster: rank {self.world.rank}'s portion thread did not end")
            bye = torch.zeros(RESULT_LEN)
            bye[0] = BYE
            with self.collective("sandblaster bye"):
                dist.send(bye, dst=0, tag=RESULT, group=self.group)

    def eval_model(self) -> torch.nn.Module | None:
        """The iterate, gathered from the shards into rank 0's model (collective: every rank calls it).
        For the test set, not for training: its bytes count apart (``bytes_to_rank0_for_eval``)."""
        before = self.collective_bytes_in
        w = self.all_gather(W, everyone=True)
        self.eval_bytes_in += self.collective_bytes_in - before
        self.collective_bytes_in = before
        if self.world.rank != 0:
            return None
        vector_to_parameters(w.to(self.params[0].device), self.params)
        return self.model

    def summary_extra(self) -> dict[str, Any]:
        if self.farm is None:
            return {}
        per_rank = self.farm.mean_portion_seconds()
        per_iteration = self.totals["bytes_to_coordinator"] / max(self.iteration, 1)
        return {f"sandblaster_{k}": v for k, v in self.totals.items()} | {
            "sandblaster_bytes_to_coordinator_per_iteration": per_iteration,
            "sandblaster_bytes_to_rank0_for_eval": self.eval_bytes_in,
            "sandblaster_copies_stopped": self.farm.stopped,
            "sandblaster_shard_holders": self.holders,
            "sandblaster_portion_s": {str(r): s for r, s in per_rank.items()},
        }

    def close(self) -> None:
        for worker in (self.worker, self.farm.local if self.farm is not None else None):
            if worker is not None:
                worker.cancel_through(worker.last_over)
                worker.close(timeout_s=1.0)

    # -- the coordinator ------------------------------------------------------------------------
    def _init_coordinator(self) -> None:
        opts = self.options
        self.history = ShardedHistory(opts.history_size)
        self.line_search = LineSearch(opts.line_search, max_evals=opts.max_evals)
        self.iteration = 0
        self.f: float | None = None
        self.data_loss = self.last_data_loss = float("nan")
        self.batch_key: list[float] | None = None
        # Over the run, for summary.json; bytes_to_coordinator: message bytes rank 0 received.
        self.totals = {"evals": 0, "backups": 0, "backup_wins": 0, "bytes_to_coordinator": 0}
        remote = list(range(1, self.world.world_size))
        self.farm = PortionFarm(
            remote, opts.num_portions, self.ctx.timeout_s, opts.backup, self.group, payload=self.payload
        )
        if self.computes_at_0:
            self.farm.add_local(self.model, self.ctx.loss_fn, self._my_slow_factor())
        self.holder_ops = HolderOps(self)
        self.ops = Gram(self.holder_ops)

    def _coordinate(self, batch: Any, bounds: list[tuple[int, int]]) -> StepResult:
        t0 = time.perf_counter()
        self.batch, self.step_stats = (
            (batch, bounds),
            {"evals": 0.0, "batch_s": 0.0, "backups": 0.0, "backup_wins": 0.0},
        )
        bytes0 = self._bytes_in()
        key = _fingerprint(batch)
        if self.f is None or self.batch_key is None or not _same(key, self.batch_key):
            self.f = self.ops.objective_at_w()  # a new batch: f and g at w on it
            self.data_loss = self.last_data_loss
        self.batch_key = key
        loss, objective = self.data_loss, self.f
        self.f, t, _ = sharded_lbfgs_iteration(
            self.ops, self.f, self.history,
            lr=self.options.lr, first=self.iteration == 0, line_search=self.line_search,
        )  # fmt: skip
        if t > 0:  # the last point evaluated is the one accepted
            self.data_loss = self.last_data_loss
        self.iteration += 1
        self.farm.end_step(loss)
        stats = self.step_stats
        for k in ("evals", "backups", "backup_wins"):
            self.totals[k] += int(stats[k])
        moved = self._bytes_in() - bytes0
        self.totals["bytes_to_coordinator"] += moved
        extra = {"objective": objective, "step_size": t, **stats}
        extra["bytes_to_coordinator"] = float(moved)
        # The portion phases (every evaluation's, summed) against the whole step, end to end.
        extra["portion_phase_s"] = stats["batch_s"]
        extra["batch_s"] = stats["batch_s"] / max(stats["evals"], 1.0)
        extra["step_s"] = time.perf_counter() - t0
        extra.update({f"portion_s_rank{r}": s for r, s in self.farm.mean_portion_seconds().items()})
        return StepResult(loss, batch_size(batch), self.timers.pop(), extra)

    def _bytes_in(self) -> int:
        """Bytes rank 0 has received in training: portion results, replies, and collectives' (with
        ``coordinator_computes``, the weights and gradients of the holders' collectives)."""
        return self.farm.bytes_in + self.holder_ops.bytes_in + self.collective_bytes_in

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {} if self.store is None else {"shard": self.store.state_dict()}
        if self.world.rank == 0:
            state.update(
                history=self.history.state_dict(),
                iteration=self.iteration,
                f=self.f,
                data_loss=self.data_loss,
                batch_key=self.batch_key,
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.store is not None and "shard" in state:
            self.store.load_state_dict(state["shard"])
        if self.world.rank == 0 and "history" in state:
            self.history.load_state_dict(state["history"])
            self.iteration = int(state["iteration"])
            self.f, self.data_loss = state["f"], float(state["data_loss"])
            self.batch_key = state["batch_key"]


def _fingerprint(batch: Any) -> list[float]:
    """Order-free sums of a batch: full-batch runs see the same set each step (reshuffled), and then
    ``f, g`` at the current weights carry over instead of being evaluated again."""
    key = [float(batch_size(batch))]
    map_tensors(lambda t: key.extend([float(t.double().sum()), float(t.double().square().sum())]), batch)
    return key


def _same(a: list[float], b: list[float]) -> bool:
    return all(abs(u - v) <= 1e-9 * max(1.0, abs(u), abs(v)) for u, v in zip(a, b))
