"""Hogwild and Dogwild: their update rules in closed form on forked workers, faults, and the digits run.

The rule tests use a model whose gradient does not depend on the weights (a bias-free linear layer
under ``loss = sum(output)``: the gradient is the column sums of the batch), so the final weights
have a closed form however the workers interleave.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from parambox.box import BoxConfig
from parambox.errors import UserError
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies import dogwild
from parambox.strategies.base import Context
from parambox.strategies.dogwild import Dogwild, DogwildOptions
from parambox.strategies.hogwild import Hogwild, HogwildOptions
from tests.conftest import final_weights, run_cli, summary
from tests.forked import fork_ranks

LR, STEPS = 0.125, 3
W0 = torch.tensor([[1.0, 2.0, -1.0, 0.5]])


def batch(rank: int) -> torch.Tensor:
    """Rank r's fixed batch; its gradient under sum(output) is its column sums: small integers."""
    return torch.tensor([[1.0, 0.0, 2.0, -1.0], [0.0, 1.0, 1.0, 1.0]]) * (1 + rank)


def momentum_sum(m: float, n: int) -> float:
    """sum_{t=1..n} of torch SGD's momentum buffer after t equal gradients, in units of the gradient."""
    return sum((1 - m**t) / (1 - m) for t in range(1, n + 1))


def _worker(rank: int, n: int, make, port: int, out_dir: str, faults: dict) -> None:
    torch.set_num_threads(1)  # forked: stay out of the parent's OpenMP pool
    world = World(rank, n, rank, n, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 20.0)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(W0)
    ctx = Context(
        world,
        model,
        lambda p: torch.optim.SGD(p, lr=LR, momentum=make.momentum),
        lambda model, batch: model(batch[0]).sum(),
        make.steps,
        20.0,
    )
    kind, at = faults.get(rank, ("", 1 << 30))
    if kind == "slow_broadcast":  # rank 0's every weights message leaves `at` seconds late
        send = dogwild._Master._send
        dogwild._Master._send = lambda self, *args: (time.sleep(at), send(self, *args))[1]
    strategy = make(ctx)
    x = batch(0 if make.same_data else rank)
    peer = getattr(strategy, "peer", None)  # a dogwild worker: the weights it adopted, step by step
    adopted: list[tuple[int, list[float]]] = []
    t0 = time.perf_counter()
    if make.ordered and rank == 1:  # Hogwild made deterministic: rank 1 starts when rank 0 is done
        while strategy.box.read_counter(strategy.counters.steps(0)) < STEPS:
            time.sleep(0.001)
    step = 0
    while not strategy.should_stop(step):
        if kind == "kill" and step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "slow":  # this rank's every step takes `at` seconds longer
            time.sleep(at)
        bad = kind == "nan" and step >= at
        strategy.step((torch.full_like(x, float("nan")) if bad else x, torch.zeros(2)), step)
        if peer is not None and (not adopted or adopted[-1][0] != peer.version):
            adopted.append((peer.version, len(peer.pending), strategy.x.tolist()))
        step += 1
    loop_s = time.perf_counter() - t0
    strategy.finish()
    result_model = strategy.eval_model()
    out = {"rank": rank, "steps": step, "loop_s": loop_s, "adopted": adopted, **strategy.summary_extra()}
    if isinstance(strategy, Dogwild):
        out["replica"] = strategy.x.tolist()
        out["max_lag"] = (peer or strategy.master).max_lag
    if result_model is not None:
        out["weights"] = result_model.weight.detach().flatten().tolist()
    strategy.close()
    pbdist.destroy_distributed()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(out))


def run_forked(make, out_dir: Path, n: int = 2, faults: dict | None = None) -> dict[int, dict]:
    """Run ``make(ctx)``'s strategy on ``n`` forked workers; the results of those not killed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fork_ranks(_worker, n, (n, make, free_port(), str(out_dir), faults or {}), timeout=40 * n)
    return {int(f.stem): json.loads(f.read_text()) for f in out_dir.glob("*.json")}


def maker(
    cls, options, momentum: float = 0.0, ordered: bool = False, same_data: bool = False, steps: int = STEPS
):
    def make(ctx):
        return cls(ctx, options)

    make.momentum, make.ordered, make.same_data, make.steps = momentum, ordered, same_data, steps
    return make


# Lazy imports (torch.optim pulls in torch._dynamo, ~1.5 s) happen once here, not in every child.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


# -- Hogwild ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hogwild_rule_each_worker_steps_the_shared_weights_with_its_own_momentum(tmp_path):
    """x <- x - lr v_i in place, v_i each worker's own momentum: w = w0 - lr S(m, K) (g_0 + g_1)."""
    res = run_forked(maker(Hogwild, HogwildOptions(), momentum=0.5, ordered=True), tmp_path)
    g0, g1 = batch(0).sum(0), batch(1).sum(0)
    expected = W0.flatten() - LR * momentum_sum(0.5, STEPS) * (g0 + g1)
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)
    assert res[0]["worker_steps"] == [STEPS, STEPS] and res[0]["lost_workers"] == []


@pytest.mark.timeout(60)
def test_hogwild_nan_worker_never_writes(tmp_path):
    """Rank 1 sees NaN inputs from its step 1: it halts; the shared weights hold only finite updates."""
    res = run_forked(maker(Hogwild, HogwildOptions(), ordered=True), tmp_path, faults={1: ("nan", 1)})
    expected = W0.flatten() - LR * (STEPS * batch(0).sum(0) + batch(1).sum(0))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)
    assert res[0]["nonfinite_workers"] == [1] and res[1]["steps"] == 2


@pytest.mark.timeout(60)
def test_hogwild_killed_worker_is_found_lost(tmp_path):
    """Rank 1 dies at its step 1: rank 0 sees its process gone and finishes with the shared weights."""
    res = run_forked(maker(Hogwild, HogwildOptions(), ordered=True), tmp_path, faults={1: ("kill", 1)})
    assert set(res) == {0} and res[0]["lost_workers"] == [1]
    expected = W0.flatten() - LR * (STEPS * batch(0).sum(0) + batch(1).sum(0))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)


def test_hogwild_refuses_rma_and_several_nodes():
    model = nn.Linear(2, 1)
    for world, box in ((World(), "rma"), (World(0, 4, 0, 2, 0, 2), "shm")):
        ctx = Context(
            world, model, lambda p: torch.optim.SGD(p, lr=0.1), None, 1, 5.0, box=BoxConfig(backend=box)
        )
        with pytest.raises(UserError, match="hogwild"):
            Hogwild(ctx, HogwildOptions())


# -- Dogwild ---------------------------------------------------------------------------------------


def grad(rank: int) -> torch.Tensor:
    return batch(rank).sum(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_dogwild_rule_plain_sgd_applies_every_gradient(n, tmp_path):
    """Momentum 0: rank 0 applies its own K gradients and each worker's K, in whatever order they
    arrive: w = w0 - lr K sum_r g_r."""
    res = run_forked(maker(Dogwild, DogwildOptions()), tmp_path, n=n)
    expected = W0.flatten() - LR * STEPS * sum(grad(r) for r in range(n))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)
    assert res[0]["worker_steps"] == [STEPS] * n and all(res[r]["steps"] == STEPS for r in range(n))


@pytest.mark.timeout(60)
def test_dogwild_rule_one_momentum_buffer_on_the_master(tmp_path):
    """Equal gradients from both ranks: the master's one momentum buffer sees 2K in a row,
    w = w0 - lr S(m, 2K) g (Hogwild's two buffers would give 2 S(m, K) g)."""
    res = run_forked(maker(Dogwild, DogwildOptions(), momentum=0.5, same_data=True), tmp_path)
    expected = W0.flatten() - LR * momentum_sum(0.5, 2 * STEPS) * grad(0)
    assert torch.allclose(torch.tensor(res[0]["weights"]), expected, atol=1e-6)


@pytest.mark.timeout(60)
def test_dogwild_nan_worker_is_reported_and_its_gradient_never_applied(tmp_path):
    res = run_forked(maker(Dogwild, DogwildOptions()), tmp_path, faults={1: ("nan", 1)})
    assert torch.equal(torch.tensor(res[0]["weights"]), W0.flatten() - LR * (STEPS * grad(0) + grad(1)))
    assert res[0]["nonfinite_workers"] == [1] and res[0]["worker_steps"] == [STEPS, 1]


@pytest.mark.timeout(60)
def test_dogwild_killed_worker_is_found_lost(tmp_path):
    """Rank 1 dies at its step 1: rank 0 sees its process gone and finishes without it. Workers do
    not wait for their sends, so the step-0 gradient, in flight when it died, may or may not have
    arrived: the weights hold exactly the gradients rank 0 counted (closed form either way)."""
    res = run_forked(maker(Dogwild, DogwildOptions()), tmp_path, faults={1: ("kill", 1)})
    assert set(res) == {0} and res[0]["lost_workers"] == [1]
    got = res[0]["worker_steps"]
    assert got[0] == STEPS and got[1] in (0, 1)
    expected = W0.flatten() - LR * (STEPS * grad(0) + got[1] * grad(1))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)


@pytest.mark.timeout(90)
def test_dogwild_killed_worker_of_three_leaves_the_others_running(tmp_path):
    """Three ranks, rank 1 killed at its step 3: rank 0 and rank 2 do all their steps, rank 1 is lost,
    and the weights hold exactly the gradients rank 0 counted. A worker alternates two message buffers,
    so its step-0 send was taken before step 2 began and two sends may still be in flight when it dies:
    rank 0 counts 1, 2 or 3 of its gradients (CI saw 1 on a loaded machine). (Receiving from any source,
    one dead peer's reset used to end rank 0's only receiver: rank 2 was declared lost too, or failed.)"""
    steps = 12
    make = maker(Dogwild, DogwildOptions(), steps=steps)
    res = run_forked(make, tmp_path, n=3, faults={1: ("kill", 3)})
    assert set(res) == {0, 2} and res[0]["lost_workers"] == [1], res.get(0)
    got = res[0]["worker_steps"]
    assert got[0] == steps and got[2] == steps and got[1] in (1, 2, 3), got
    expected = W0.flatten() - LR * (steps * (grad(0) + grad(2)) + got[1] * grad(1))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)
    assert torch.equal(torch.tensor(res[2]["replica"]), expected)


@pytest.mark.timeout(90)
def test_dogwild_master_killed_the_lowest_survivor_takes_over_with_every_gradient_counted(
    tmp_path, monkeypatch
):
    """Three ranks, the master (rank 0) killed at its step 3, no restart: rank 1 becomes the master from
    its replica, rank 2 meets it, both do all their steps. The result is exactly w0 - lr sum_r c_r g_r
    with c_r the gradients of each rank it holds (``applied_gradients``): rank 1's every one, rank 0's
    at most 3, rank 2's all but the few its death cost (at most max_ahead + 2, and the step whose send
    failed); rank 2's replica ends equal to it, and the failover store is removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the failover store's folder, in the children
    steps = 12
    res = run_forked(
        maker(Dogwild, DogwildOptions(), steps=steps), tmp_path / "out", n=3, faults={0: ("kill", 3)}
    )
    assert set(res) == {1, 2}, res
    lead = res[1]
    assert lead["master"] == 1 and lead["lost_workers"] == [0], lead
    held = lead["applied_gradients"]
    assert held[1] == steps and held[0] <= 3 and steps - 4 <= held[2] <= steps, held
    assert lead["worker_steps"][1:] == [steps, steps]
    expected = W0.flatten() - LR * sum(held[r] * grad(r) for r in range(3))
    assert torch.equal(torch.tensor(lead["weights"]), expected)
    assert torch.equal(torch.tensor(res[2]["replica"]), expected)
    assert not list(tmp_path.glob("parambox-dogwild-*"))


@pytest.mark.timeout(90)
def test_dogwild_a_master_that_took_over_may_die_too(tmp_path, monkeypatch):
    """Four ranks: rank 0 killed at its step 3, then rank 1, its successor, at its step 8. Rank 2 takes
    over from rank 1 as rank 1 did from rank 0; the result is still exactly w0 - lr sum_r c_r g_r (the
    counts carried through both failovers in the weights' broadcasts), and rank 3's replica ends equal
    to it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    steps = 12
    make = maker(Dogwild, DogwildOptions(), steps=steps)
    res = run_forked(make, tmp_path / "out", n=4, faults={0: ("kill", 3), 1: ("kill", 8)})
    assert set(res) == {2, 3}, res
    lead = res[2]
    assert lead["master"] == 2 and lead["lost_workers"] == [0, 1], lead
    held = lead["applied_gradients"]
    # rank 2 lost a few of its gradients at the first failover (as a worker), rank 3 at both
    assert (
        held[0] <= 3 and held[1] <= 8 and steps - 4 <= held[2] <= steps and steps - 8 <= held[3] <= steps
    ), held
    expected = W0.flatten() - LR * sum(held[r] * grad(r) for r in range(4))
    assert torch.equal(torch.tensor(lead["weights"]), expected)
    assert torch.equal(torch.tensor(res[3]["replica"]), expected)


@pytest.mark.timeout(60)
def test_dogwild_master_shares_every_update_with_all_workers(tmp_path):
    """Three ranks, equal constant gradients g, plain SGD: after v arrivals w = w0 - lr v g, whatever
    the order. A worker applies its own gradient to its replica too: after each step its replica is
    the weights it adopted (version v) plus its own p steps those weights do not hold yet, exactly
    w0 - lr (v + p) g. The master ends at version 3K, and every replica ends equal to it (the final
    broadcast, which holds every gradient)."""
    res = run_forked(maker(Dogwild, DogwildOptions(), same_data=True), tmp_path, n=3)

    def at(v: int) -> torch.Tensor:
        return W0.flatten() - LR * v * grad(0)

    final = at(3 * STEPS)
    assert torch.equal(torch.tensor(res[0]["weights"]), final)
    for r in range(3):
        assert torch.equal(torch.tensor(res[r]["replica"]), final), r
    for r in (1, 2):
        versions = [v for v, _, _ in res[r]["adopted"]]
        assert versions == sorted(versions) and all(0 <= v <= 3 * STEPS for v in versions)
        for v, own, x in res[r]["adopted"]:
            assert own >= 1 and torch.equal(torch.tensor(x), at(v + own)), (r, v, own)
    assert all(n >= 1 for n in res[0]["weights_broadcasts"])


@pytest.mark.timeout(60)
def test_dogwild_worker_never_waits_for_weights(tmp_path):
    """Rank 0's weights messages each leave 1 s late: the worker still does its steps at once, on the
    weights it has (the old protocol waited for a reply every step: >= 3 s), and all gradients land."""
    opts = DogwildOptions(max_ahead=None)  # the default bound (1) would wait from step 2 on
    res = run_forked(maker(Dogwild, opts), tmp_path, faults={0: ("slow_broadcast", 1.0)})
    assert res[1]["loop_s"] < 0.8, res[1]["loop_s"]
    expected = W0.flatten() - LR * STEPS * (grad(0) + grad(1))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)
    assert torch.equal(torch.tensor(res[1]["replica"]), expected)  # the final broadcast, late but there


@pytest.mark.timeout(90)
@pytest.mark.parametrize("max_ahead", [1, None])
def test_dogwild_max_ahead_bounds_the_lag_behind_every_worker(max_ahead, tmp_path):
    """Three ranks, rank 2 taking 0.1 s longer per step, 10 steps. With max_ahead=1 no rank ever
    computes on weights that miss any rank's gradients from before its previous step (lag <= 1, the
    slow worker's included: the fast ones wait for it); without a bound the fast ranks run ahead of
    the slow one (lag > 1). Every gradient lands either way (plain SGD: closed form)."""
    steps = 10
    make = maker(Dogwild, DogwildOptions(max_ahead=max_ahead), steps=steps)
    res = run_forked(make, tmp_path, n=3, faults={2: ("slow", 0.1)})
    lags = [res[r]["max_lag"] for r in range(3)]
    if max_ahead is None:
        assert max(lags[:2]) > 1, lags
    else:
        assert max(lags) <= max_ahead, lags
    expected = W0.flatten() - LR * steps * sum(grad(r) for r in range(3))
    assert torch.equal(torch.tensor(res[0]["weights"]), expected)


# -- the CLI, as a user runs it ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("args", [["--preset", "digits-hogwild"], ["--preset", "digits-dogwild"]])
def test_default_digits_run_reaches_093(args, tmp_path):
    out = tmp_path / "run"
    run_cli("train", *args, "--out", str(out), "--no-progress")
    s = summary(out)
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
    assert (s["worker_steps"], s["lost_workers"], s["nonfinite_workers"]) == ([600, 600], [], [])


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_dogwild_sigkilled_worker_run_ends_with_code_0(tmp_path):
    out = tmp_path / "run"
    args = [
        "--strategy",
        "dogwild",
        "--model",
        "mlp",
        "--steps",
        "200",
        "--eval-every",
        "0",
        "--threads",
        "1",
    ]
    proc = run_cli("train", *args, "--out", str(out), "--no-progress", env={"PARAMBOX_FAULT": "1:30:kill"})
    s = summary(out)
    assert s["lost_workers"] == [1] and s["worker_steps"][0] == 200
    assert "lost" in proc.stderr
    assert all(torch.isfinite(w).all() for w in final_weights(out).values())


@pytest.mark.timeout(170)
def test_dogwild_killed_worker_is_replaced_with_max_restarts(tmp_path):
    """Three ranks, rank 1 SIGKILLed at step 30, --max-restarts 1: its replacement meets rank 0 over a
    pair group of its own and does the steps its predecessor had not; nobody is lost. (It used to
    wait forever to join the run's process group, and rank 1 ended lost.)"""
    out = tmp_path / "run"
    args = ["--strategy", "dogwild", "--workers", "3", "--model", "mlp", "--steps", "150"]
    args += ["--eval-every", "0", "--threads", "1", "--max-restarts", "1", "--timeout", "60"]
    proc = run_cli("train", *args, "--out", str(out), "--no-progress", env={"PARAMBOX_FAULT": "1:30:kill"})
    s = summary(out)
    assert (s["restarts"], s["lost_workers"], s["worker_steps"]) == (1, [], [150, 150, 150]), proc.stderr
    assert "replaced" in proc.stderr
    assert all(torch.isfinite(w).all() for w in final_weights(out).values())
