"""``sandblaster``: the dispatch policy and L-BFGS maths (tier a), the distributed run against
``torch.optim.LBFGS`` in one process, and backups beating a slow worker (tier c)."""

from __future__ import annotations

import heapq
import json
import queue
import time

import pytest
import torch
import torch.nn.functional as F

from parambox.data import load_dataset
from parambox.models import build_model
from parambox.strategies.sandblaster.lbfgs import LBFGSHistory, LineSearch, lbfgs_iteration
from parambox.strategies.sandblaster.portions import PortionScheduler
from parambox.strategies.sandblaster.shards import (
    G,
    Gram,
    LocalOps,
    ShardedHistory,
    W,
    sharded_lbfgs_iteration,
)
from parambox.strategies.sandblaster.worker import PortionWorker
from tests.conftest import final_weights, run_cli, summary


# -- tier (a): dispatch ----------------------------------------------------------------------------
def simulate(costs: dict[int, float], num_portions: int, backup: bool) -> tuple[float, PortionScheduler]:
    """Event-driven batch: worker w needs costs[w] per portion; returns (batch time, scheduler)."""
    sched = PortionScheduler(num_portions, backup=backup)
    events: list[tuple[float, int, int]] = []
    idle: list[int] = []
    for w in sorted(costs):
        p = sched.next_for(w)
        heapq.heappush(events, (costs[w], w, p))
    winners: dict[int, int] = {}
    while not sched.done:
        t, w, p = heapq.heappop(events)
        if sched.complete(w, p):
            winners[p] = w
        for v in [w, *idle]:
            nxt = sched.next_for(v)
            if nxt is None:
                idle = sorted({*idle, v})
            else:
                idle = [u for u in idle if u != v]
                heapq.heappush(events, (t + costs[v], v, nxt))
    assert sorted(winners) == list(range(num_portions))  # every portion counted exactly once
    return t, sched


def test_backups_cut_the_tail_a_slow_worker_leaves():
    # Fast worker 0 (1 s/portion), worker 1 five times slower, 8 portions. Without backups the
    # batch waits for portion 6, handed to worker 1 at t=5: t=10. With backups worker 0, idle at
    # t=6, copies it and wins at t=7.
    t_plain, plain = simulate({0: 1.0, 1: 5.0}, 8, backup=False)
    t_backup, sched = simulate({0: 1.0, 1: 5.0}, 8, backup=True)
    assert (t_plain, plain.backups) == (10.0, 0)
    assert (t_backup, sched.backups, sched.backup_wins) == (7.0, 1, 1)


def test_no_backup_while_fresh_portions_remain_and_at_most_two_copies():
    s = PortionScheduler(3)
    assert [s.next_for(w) for w in (1, 2, 3)] == [0, 1, 2] and s.backups == 0
    assert s.next_for(4) == 0 and s.next_for(5) == 1  # copies, earliest started first
    assert s.next_for(1) == 2  # the one portion with a single copy, not its own
    assert s.next_for(6) is None and s.backups == 3  # every portion has two copies now
    assert s.complete(1, 0) and not s.complete(4, 0)  # the first result wins
    assert s.backup_wins == 0 and not s.done


# -- tier (a): the compute thread -----------------------------------------------------------------
def test_a_copy_whose_evaluation_is_over_stops_at_once_and_says_it_is_free():
    """A 1000x slow worker's copy in flight answers within a second of its evaluation's end, with 0
    samples and no gradient kept; a portion of an evaluation already over is not computed at all."""
    got: queue.Queue = queue.Queue()
    model = torch.nn.Linear(3, 2)
    batch = ((torch.randn(40, 3), torch.randint(0, 2, (40,))), [(0, 20), (20, 40)])
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    w = PortionWorker(model, loss, got.put, slow_factor=1000.0)
    w.submit(1, 0, None, batch)
    time.sleep(0.3)  # computed, now in the slow machine's extra time
    t0 = time.perf_counter()
    w.cancel_through(1)
    out = got.get(timeout=5)
    assert time.perf_counter() - t0 < 1.0 and out.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    w.submit(1, 1, None, batch)  # evaluation 1 is over: stopped before the forward pass
    assert got.get(timeout=5)[3] == 0 and w.stopped == 2 and w.computed == 0 and not w.grads.grads
    fast = PortionWorker(model, loss, got.put)
    fast.submit(2, 1, None, batch)
    out = got.get(timeout=5)
    assert out[:4].tolist()[:2] == [2.0, 1.0] and out[3] == 20 and (2, 1) in fast.grads.grads
    assert w.close(5) and fast.close(5)


# -- tier (a): L-BFGS ------------------------------------------------------------------------------
def test_two_loop_recursion_equals_the_dense_bfgs_inverse():
    g = torch.Generator().manual_seed(0)
    n, hist = 6, LBFGSHistory(history_size=3)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    hess = a @ a.T + n * torch.eye(n, dtype=torch.float64)
    for _ in range(5):  # two pairs fall out of the history
        s = torch.randn(n, generator=g, dtype=torch.float64)
        assert hist.update(s, hess @ s)
    h = hist.h_diag * torch.eye(n, dtype=torch.float64)
    for s, y, rho in zip(hist.s, hist.y, hist.rho):
        v = torch.eye(n, dtype=torch.float64) - rho * torch.outer(y, s)
        h = v.T @ h @ v + rho * torch.outer(s, s)
    grad = torch.randn(n, generator=g, dtype=torch.float64)
    assert torch.allclose(hist.direction(grad), -h @ grad, atol=1e-12)
    assert not hist.update(grad, -grad)  # negative curvature: not kept


def _logistic_problem(weight_decay: float):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] - x[:, 1] + 0.5 * torch.randn(200, generator=g) > 0).long()

    def objective(w: torch.Tensor) -> torch.Tensor:
        logits = x @ w.view(5, 2)
        return F.cross_entropy(logits, y) + 0.5 * weight_decay * w.dot(w)

    def evaluate(w: torch.Tensor) -> tuple[float, torch.Tensor]:
        w = w.detach().requires_grad_(True)
        f = objective(w)
        f.backward()
        return float(f.detach()), w.grad

    return objective, evaluate


def test_without_line_search_iterates_are_torch_lbfgs():
    objective, evaluate = _logistic_problem(0.0)
    w_torch = torch.zeros(10, requires_grad=True)
    opt = torch.optim.LBFGS([w_torch], lr=0.5, max_iter=1, history_size=4, line_search_fn=None)

    def closure():
        opt.zero_grad()
        loss = objective(w_torch)
        loss.backward()
        return loss

    w = torch.zeros(10)
    f, g = evaluate(w)
    hist = LBFGSHistory(4)
    for i in range(15):
        opt.step(closure)
        w, f, g, _, evals = lbfgs_iteration(evaluate, w, f, g, hist, lr=0.5, first=i == 0)
        assert evals == 1
        assert torch.allclose(w, w_torch.detach(), atol=1e-6), i


def test_armijo_reaches_torch_strong_wolfe_minimum():
    objective, evaluate = _logistic_problem(1e-2)
    w_torch = torch.zeros(10, requires_grad=True)
    opt = torch.optim.LBFGS([w_torch], max_iter=200, line_search_fn="strong_wolfe", tolerance_change=1e-12)
    opt.step(lambda: (opt.zero_grad(), objective(w_torch).backward(), objective(w_torch))[2])
    w, hist = torch.zeros(10), LBFGSHistory(10)
    f, g = evaluate(w)
    for i in range(50):
        w, f, g, _, _ = lbfgs_iteration(evaluate, w, f, g, hist, first=i == 0, line_search=LineSearch())
    assert f == pytest.approx(float(objective(w_torch.detach())), abs=1e-7)


@pytest.mark.parametrize("line_search", ["none", "armijo"])
@pytest.mark.parametrize("num_shards,decay_on_shards", [(1, False), (3, False), (3, True)])
def test_sharded_iteration_is_lbfgs_iteration_on_shards(line_search, num_shards, decay_on_shards):
    """The coordinator's vector-free iteration on shards gives lbfgs.py's iterates (up to float32
    rounding: both take their dot products in the vectors' precision, as torch.optim.LBFGS does, but
    add them in another order), history wrap-around included; with the weight decay on the shards,
    its term in every trial's objective comes from the dot products alone."""
    _, evaluate = _logistic_problem(1e-2)
    ls = LineSearch(line_search)
    w, hist = torch.zeros(10), LBFGSHistory(3)
    f, g = evaluate(w)
    data_only = _logistic_problem(0.0)[1] if decay_on_shards else evaluate
    local = LocalOps(
        torch.zeros(10), data_only, num_shards, history_size=3, weight_decay=1e-2 * decay_on_shards
    )
    ops, shist = Gram(local), ShardedHistory(3)
    asked = []  # the holders' round trips: one per iteration, whatever the line search evaluates
    local.reduce = lambda *a, reduce=local.reduce: asked.append(a) or reduce(*a)
    f_s = ops.objective_at_w()
    assert len(asked) == 1
    for i in range(12):
        w, f, g, t, n = lbfgs_iteration(evaluate, w, f, g, hist, lr=0.5, first=i == 0, line_search=ls)
        before = len(asked)
        f_s, t_s, n_s = sharded_lbfgs_iteration(ops, f_s, shist, lr=0.5, first=i == 0, line_search=ls)
        assert len(asked) - before == 1 + (i == 0), i  # the first also fills the start's products
        assert (n_s, len(shist)) == (n, len(hist)) and t_s == pytest.approx(t, rel=1e-5), i
        assert torch.allclose(local.gather(W), w, atol=3e-6) and torch.allclose(
            local.gather(G), g, atol=1e-6
        ), i
        assert f_s == pytest.approx(f, abs=1e-7)


# -- tier (c): the distributed run -----------------------------------------------------------------
def _train_objective(state: dict[str, torch.Tensor], weight_decay: float) -> float:
    ds = load_dataset("digits")
    model = build_model("logreg", ds.input_shape, ds.num_classes)
    model.load_state_dict(state)
    with torch.no_grad():
        loss = F.cross_entropy(model(ds.train_x), ds.train_y)
        return float(loss) + 0.5 * weight_decay * sum(float((p * p).sum()) for p in model.parameters())


def _torch_lbfgs_full_batch(weight_decay: float) -> float:
    ds = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("logreg", ds.input_shape, ds.num_classes)
    opt = torch.optim.LBFGS(
        model.parameters(),
        max_iter=500,
        history_size=10,
        line_search_fn="strong_wolfe",
        tolerance_change=1e-12,
    )

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(ds.train_x), ds.train_y)
        loss = loss + 0.5 * weight_decay * sum((p * p).sum() for p in model.parameters())
        loss.backward()
        return loss

    opt.step(closure)
    return _train_objective(model.state_dict(), weight_decay)


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("sandblaster") / "run"
    run_cli("train", "--preset", "digits-sandblaster", "--no-progress", "--threads", "1", "--out", str(out))
    return out


@pytest.mark.timeout(150)
def test_two_workers_reach_torch_lbfgs_training_loss_and_90_percent(two_workers):
    s = summary(two_workers)
    assert (s["strategy"], s["workers"], s["model"], s["batch_size"]) == ("sandblaster", 2, "logreg", 1438)
    reached = _train_objective(final_weights(two_workers), 1e-3)
    assert reached == pytest.approx(_torch_lbfgs_full_batch(1e-3), abs=1e-4)
    assert s["final_test_accuracy"] >= 0.9
    # Portions are summed exactly once: step 1's loss is the full batch's at the initial weights.
    torch.manual_seed(0)
    ds = load_dataset("digits")
    init = build_model("logreg", ds.input_shape, ds.num_classes).state_dict()
    assert _steps(two_workers)[0]["loss"] == pytest.approx(_train_objective(init, 0.0), abs=1e-5)


def _bytes_bound(steps: list[dict], num_portions: int, history_size: int, holders: int) -> list[float]:
    """What a step may send the coordinator, counted from scalars alone: per evaluation at most two
    copies of every portion's result (5 float32) and the weight-decay reduction (a dot product and
    two norms, float64), per iteration one block of reductions (the new gradient's and pair's dot
    products with the 2m + 3 vectors of the basis, two norms) and the first step's (three floats).
    Per remote holder each."""
    per_eval = 2 * num_portions * 5 * 4 + 8 * holders * 3
    per_iteration = 8 * holders * (3 * (2 * history_size + 3) + 2 + 3)
    return [r["evals"] * per_eval + per_iteration for r in steps]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_only_scalars_reach_the_coordinator_whatever_the_model_size(tmp_path):
    """bytes_to_coordinator per L-BFGS iteration, collectives included, in the default configuration
    (rank 0 only coordinates): within a bound made of scalars alone, the same bound for logreg (650
    parameters) and lenet (21,386), and below one lenet gradient (85 kB; before the shards every
    portion brought one). The counter sees collectives: with coordinator_computes=true rank 0 joins
    the holders' all-gather and all-reduce, and logreg's steps then count more than its weights."""
    for model, computes in (("logreg", None), ("lenet", None), ("logreg", "true")):
        out = tmp_path / f"{model}-{computes}"
        extra = ["--set", f"sandblaster.coordinator_computes={computes}"] if computes else []
        run_cli(
            "train", "--preset", "digits-sandblaster", "--model", model, "--steps", "3", "--eval-every", "0",
            "--no-progress", "--threads", "1", *extra, "--out", str(out),
        )  # fmt: skip
        steps, s = _steps(out), summary(out)
        got = [r["bytes_to_coordinator"] for r in steps]
        assert s["sandblaster_bytes_to_coordinator"] == sum(got)
        if computes:
            assert s["sandblaster_shard_holders"] == [0, 1]
            assert all(b > r["evals"] * 650 * 4 for b, r in zip(got, steps)), got
            continue
        assert all(0 < b <= bound for b, bound in zip(got, _bytes_bound(steps, 16, 10, 1))), got
        assert max(got) < 21386 * 4
        assert s["sandblaster_shard_holders"] == [1]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_computing_coordinator_with_two_workers_follows_the_same_iterates(two_workers, tmp_path):
    """Rank 0 computes too, with 3 ranks: the same L-BFGS path as the default 2-rank run (rank 0
    only dispatches, rank 1 computes)."""
    out = tmp_path / "run"
    run_cli(
        "train", "--preset", "digits-sandblaster", "--workers", "3", "--steps", "5", "--no-progress",
        "--threads", "1", "--set", "sandblaster.coordinator_computes=true", "--out", str(out),
    )  # fmt: skip
    here, there = _steps(out), _steps(two_workers)[:5]
    assert [r["loss"] for r in here] == pytest.approx([r["loss"] for r in there], abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_slowed_5x_does_not_hold_the_batch_up():
    """`parambox bench sandblaster --quick`: backup copies win portions, copies in flight are stopped,
    and the path is the same as without backups. Its timings (the whole step against the same run
    without backups, and against its portion phase: the issue's Must show) are the benchmark's full
    form, not asserted here: a timed unit test on a shared 2-core machine fails on load, not on the
    code."""
    r = json.loads(run_cli("bench", "sandblaster", "--quick", "--json", timeout=280).stdout)
    (one,) = r["rounds_measured"]
    assert r["same_path"] and one["backup_wins"] >= 1 and one["copies_stopped"] >= 1
    # the slowdown is real (None: every copy the slow worker ran was beaten and stopped)
    assert one["slow_portion_over_fast"] is None or one["slow_portion_over_fast"] > 2.0
    assert one["bytes_to_coordinator_per_step"] < 10_000  # scalars only, whatever the model's size
    assert {"step_over_portion_phase", "saved", "targets"} <= set(r)
