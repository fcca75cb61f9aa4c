"""The loop's training features (issue 48, Build 2): gradient clipping, accumulation, mixed precision and
learning-rate schedules with warmup, in ``parambox train`` and ``parambox.train``.

Tier (a): the schedule's factors, the micro-batch split, accumulation with clipping equal to one big
batch clipped by hand, a loss scaler's skipped step, on plain tensors in this process. Tier (b): two
workers on loopback. Tier (c): a run killed after a checkpoint and resumed ends where the uninterrupted
run ends, on the command line and through ``parambox.train``.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from torch import nn

import parambox
from parambox import cli
from parambox.config import build_config
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies import Context, build_strategy
from parambox.strategies.downpour import AdagradRates
from parambox.strategies.easgd import NesterovStep
from parambox.strategies.microsteps import split_batch
from parambox.training.schedule import Schedule, ScheduledRates, lr_factor
from tests.conftest import NUMERICS, final_weights, max_abs_diff, run_cli, summary

# -- tier (a) -------------------------------------------------------------------------------------------


def test_schedules_warm_up_linearly_then_decay_to_zero_at_the_last_step():
    assert [lr_factor(s, "constant", 0, 10) for s in (0, 9, 50)] == [1.0, 1.0, 1.0]
    assert [lr_factor(s, "linear", 4, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # after the warmup: 1 at its end, half way at the middle of the rest, 0 at the horizon and beyond
    for kind in ("cosine", "linear"):
        assert lr_factor(4, kind, 4, 12) == 1.0
        assert lr_factor(8, kind, 4, 12) == pytest.approx(0.5)
        assert lr_factor(12, kind, 4, 12) == pytest.approx(0.0, abs=1e-12)
        assert lr_factor(30, kind, 4, 12) == pytest.approx(0.0, abs=1e-12)
        assert lr_factor(11, kind, 4, 12) > 0  # the last step still moves
    assert lr_factor(6, "cosine", 4, 12) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(6, "linear", 4, 12) == pytest.approx(0.75)


def test_scheduled_rates_set_every_optimizer_made_and_pause_for_a_skipped_step():
    rates = ScheduledRates(lambda p: torch.optim.SGD(p, lr=0.2), Schedule("cosine", 2, 10))
    a = rates.make([nn.Parameter(torch.zeros(1))])
    b = rates.make([{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.4}])  # its own group rate
    rates.apply(0)
    assert (a.param_groups[0]["lr"], b.param_groups[0]["lr"]) == pytest.approx((0.1, 0.2))
    rates.apply(6)
    assert a.param_groups[0]["lr"] == pytest.approx(0.2 * lr_factor(6, "cosine", 2, 10))
    with rates.paused():
        assert a.param_groups[0]["lr"] == 0.0 and b.param_groups[0]["lr"] == 0.0
    assert a.param_groups[0]["lr"] == pytest.approx(0.2 * lr_factor(6, "cosine", 2, 10))
    late = rates.make([nn.Parameter(torch.zeros(1))])  # made during step 6 (a pipeline's first step)
    assert late.param_groups[0]["lr"] == a.param_groups[0]["lr"]
    # a constant schedule without warmup leaves the rates exactly as made (a loaded optimizer's too)
    still = ScheduledRates(lambda p: torch.optim.SGD(p, lr=0.3), Schedule("constant", 0, 10))
    c = still.make([nn.Parameter(torch.zeros(1))])
    c.param_groups[0]["lr"] = 0.7
    still.apply(5)
    assert c.param_groups[0]["lr"] == 0.7


def test_strategies_with_their_own_update_read_the_scheduled_rate_each_step():
    """eamsgd's Nesterov step and downpour's Adagrad keep no rate of their own: the schedule reaches them."""
    group = {"lr": 0.1, "momentum": 0.5}
    x = torch.zeros(2)
    nesterov = NesterovStep(x, group["lr"], group["momentum"], group)
    group["lr"] = 0.02  # as ScheduledRates.apply sets it
    nesterov.step_(torch.ones(2))
    assert x.tolist() == pytest.approx([-0.02, -0.02]) and nesterov.v.tolist() == pytest.approx(
        [-0.02, -0.02]
    )
    adagrad = AdagradRates(None, 2, 0.1, x.device, group)  # step_ alone needs no box
    group["lr"] = 0.01
    adagrad.step_(x, torch.full((2,), 2.0))
    assert x.tolist() == pytest.approx([-0.03, -0.03], abs=1e-6)  # g / sqrt(g^2) = 1


def test_split_batch_cuts_dim_zero_into_shares_and_keeps_other_tensors_whole():
    x, y, scale = torch.arange(12.0).view(6, 2), torch.arange(6), torch.tensor(3.0)
    parts = split_batch({"x": x, "y": y, "scale": scale, "name": "b"}, 3)
    assert [s for _, s in parts] == pytest.approx([1 / 3] * 3)
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), x)
    assert [p["y"].tolist() for p, _ in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["scale"] is scale and p["name"] == "b" for p, _ in parts)
    uneven = split_batch((torch.zeros(5, 1), torch.zeros(5)), 2)
    assert [len(p[0]) for p, _ in uneven] == [3, 2] and [s for _, s in uneven] == [0.6, 0.4]
    assert len(split_batch(torch.zeros(2, 1), 4)) == 2  # fewer samples than micro-batches


def _mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _single(model: nn.Module, lr: float = 0.1, **features) -> object:
    ctx = Context(World(), model, lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9), _mse, 5, 5.0, **features)
    return build_strategy("single", ctx)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_accumulated_clipped_micro_batches_equal_one_big_batch_clipped_by_hand():
    torch.manual_seed(1)
    batches = [(torch.randn(16, 4) * 3, torch.randn(16, 2) * 5) for _ in range(4)]
    accumulated = _model()
    strategy = _single(accumulated, grad_accum=4, grad_clip=0.5)
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(batches):
        result = strategy.step(batch, step)
        opt.zero_grad()
        loss = _mse(reference, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        assert result.samples == 16 and result.loss == pytest.approx(float(loss.detach()), rel=1e-6)
        assert result.extra["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
        assert float(norm) > 0.5  # the clip did cut
    for a, b in zip(accumulated.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_loss_scaler_unscales_exactly_and_skips_a_step_with_an_inf_gradient():
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    plain, scaled = _model(), _model()
    rates = ScheduledRates(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), Schedule())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ctx = Context(World(), scaled, rates.make, _mse, 5, 5.0, scaler=scaler, pause_rates=rates.paused)
    strategy = build_strategy("single", ctx)
    _single(plain).step(batch, 0)
    result = strategy.step(batch, 0)
    assert result.extra["loss_scale"] == 2.0**10 and "skipped" not in result.extra
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b)  # a power of two: unscaled exactly
    before = [p.detach().clone() for p in scaled.parameters()]
    ctx.loss_fn = lambda model, b: _mse(model, b) * float("inf")
    result = strategy.step(batch, 1)
    assert result.extra["skipped"] == 1.0 and scaler.get_scale() == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters()))  # the weights stay
    assert strategy.optimizer.param_groups[0]["lr"] == 0.1  # and the rate is back


def test_bf16_runs_forward_under_autocast_and_keeps_fp32_weights_and_gradients():
    seen = []
    model = _model()
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    strategy = _single(model, precision="bf16")
    result = strategy.step((torch.randn(8, 4), torch.randn(8, 2)), 0)
    assert seen == [torch.bfloat16] and math.isfinite(result.loss)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(
    "layer,message",
    [
        ({"batch_size": 30, "grad_accum": 4}, "batch_size 30 does not split into grad_accum 4"),
        (
            {"strategy": "pipeline", "workers": 2, "grad_accum": 2},
            "strategy 'pipeline' does not take grad_accum",
        ),
        ({"strategy": "pipeline", "workers": 2, "grad_clip": 1.0}, "'pipeline' does not take grad_clip"),
        ({"strategy": "sandblaster", "precision": "bf16"}, "'sandblaster' does not take precision"),
        ({"strategy": "sandblaster", "warmup_steps": 5}, "its step length is sandblaster.lr"),
        ({"lr_schedule": "step"}, "lr_schedule"),
    ],
)
def test_features_a_strategy_cannot_take_are_refused_naming_strategy_and_field(layer, message):
    with pytest.raises(parambox.UserError, match=message):
        build_config(layer)


def test_the_fields_take_the_cli_spellings():
    cfg = build_config({"grad_clip": "none", "grad_accum": "4", "precision": "bf16", "warmup_steps": "3"})
    assert (cfg.grad_clip, cfg.grad_accum, cfg.precision, cfg.warmup_steps) == (None, 4, "bf16", 3)
    with pytest.raises(parambox.UserError, match="grad_clip"):
        build_config({"grad_clip": -1})


def test_fp16_runs_under_a_loss_scaler_on_the_cpu_too(tmp_path):
    """The scaler of the worker's device: its scale in every step's record, halved at each overflow
    from the default 2**16 (the digits' logistic regression overflows fp16's gradients at first)."""
    out = tmp_path / "r"
    args = ["train", "--strategy", "single", "--model", "logreg", "--steps", "30", "--precision", "fp16"]
    assert cli.main([*args, "--out", str(out), "--no-progress", "--eval-every", "0", "--threads", "1"]) == 0
    scales = [r["loss_scale"] for r in _step_records(out)]
    assert len(scales) == 30 and scales[0] <= 2.0**16
    assert all(b in (a, a / 2) for a, b in zip(scales, scales[1:]))  # no growth in 30 steps (2000)
    assert summary(out)["final_test_accuracy"] > 0.5


def test_a_resumed_run_keeps_the_schedule_it_started_with_also_when_it_runs_longer(tmp_path, capsys):
    out = str(tmp_path / "r")
    args = ["train", "--strategy", "single", "--model", "logreg", "--lr", "0.1", "--batch-size", "8"]
    args += ["--out", out, "--no-progress", "--eval-every", "0", "--threads", "1"]
    assert cli.main([*args, "--steps", "6", "--lr-schedule", "linear", "--warmup-steps", "2"]) == 0
    assert cli.main(["train", "--out", out, "--resume", "--steps", "9", "--no-progress"]) == 0
    assert "keeps the horizon it started with (6 steps, not 9)" in capsys.readouterr().err
    rates = [r["lr"] for r in _step_records(tmp_path / "r")]
    assert rates == pytest.approx([0.1 * lr_factor(s, "linear", 2, 6) for s in range(9)])
    assert rates[6:] == [0.0, 0.0, 0.0]


# -- tier (b) -------------------------------------------------------------------------------------------


def _scaled_worker(rank: int, port: int, out: str) -> None:
    """weight-avg with a loss scaler (on the CPU here); rank 1's loss is inf at step 1."""
    torch.set_num_threads(1)
    world = World(rank, 2, rank, 2, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 30.0)
    try:
        rates = ScheduledRates(lambda p: torch.optim.SGD(p, lr=0.1), Schedule())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        model = _model()

        def loss(m: nn.Module, batch) -> torch.Tensor:
            return _mse(m, batch[:2]) * (float("inf") if batch[2] else 1.0)

        ctx = Context(world, model, rates.make, loss, 3, 30.0, scaler=scaler, pause_rates=rates.paused)
        strategy = build_strategy("weight-avg", ctx)
        torch.manual_seed(rank)
        weights, skipped = [], []
        for step in range(3):
            batch = (torch.randn(8, 4), torch.randn(8, 2), rank == 1 and step == 1)
            skipped.append("skipped" in strategy.step(batch, step).extra)
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
        strategy.close()
        result = {"weights": weights, "skipped": skipped, "scale": scaler.get_scale()}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        pbdist.destroy_distributed()


@pytest.mark.timeout(60)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """fp16's rule in lockstep strategies, as DDP: every rank takes the same skip decision and keeps the
    same loss scale, so the replicas stay equal."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_scaled_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    a, b = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert a["skipped"] == b["skipped"] == [False, True, False]
    assert a["scale"] == b["scale"] == 2.0**9
    assert a["weights"][1] == a["weights"][0] and a["weights"] == b["weights"]


@pytest.mark.timeout(120)
def test_single_with_four_micro_batches_equals_single_with_one(tmp_path, single_b32):
    out = tmp_path / "accum"
    run_cli(
        "train",
        "--strategy",
        "single",
        "--batch-size",
        "32",
        "--grad-accum",
        "4",
        "--out",
        str(out),
        *NUMERICS,
    )
    assert max_abs_diff(final_weights(out), single_b32) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_weight_avg_workers_with_micro_batches_equal_single_at_the_global_batch(tmp_path, single_b32):
    """weight-avg with period 1 and plain SGD averages every step: one process at the global batch."""
    out = tmp_path / "wa"
    run_cli(
        "train", "--strategy", "weight-avg", "--workers", "2", "--batch-size", "16", "--grad-accum", "4",
        "--out", str(out), *NUMERICS,
    )  # fmt: skip
    assert max_abs_diff(final_weights(out), single_b32) <= 1e-5


@pytest.mark.timeout(120)
def test_two_easgd_workers_clip_their_local_gradients_under_a_cosine_schedule(tmp_path):
    out = tmp_path / "easgd"
    run_cli(
        "train", "--strategy", "easgd", "--workers", "2", "--model", "mlp", "--steps", "12",
        "--batch-size", "8", "--grad-clip", "0.05", "--grad-accum", "2", "--lr-schedule", "cosine",
        "--warmup-steps", "3", "--precision", "bf16", "--eval-every", "0", "--no-progress", "--threads", "1",
        "--out", str(out),
    )  # fmt: skip
    steps = _step_records(out)
    assert len(steps) == 12 and all(r["grad_norm"] > 0 for r in steps)
    lr = summary(out)["config"]["lr"]
    assert [r["lr"] for r in steps] == pytest.approx([lr * lr_factor(s, "cosine", 3, 12) for s in range(12)])
    assert all(math.isfinite(float(t.abs().max())) for t in final_weights(out).values())


def _step_records(run_dir) -> list[dict]:
    """Rank 0's step records, the last of each step (a resumed run appends the steps it repeats)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return list({r["step"]: r for r in records if r["kind"] == "step"}.values())


# -- tier (c) -------------------------------------------------------------------------------------------

FEATURES = ["--grad-clip", "1", "--grad-accum", "4", "--lr-schedule", "cosine", "--warmup-steps", "20"]
RESUMED = [
    "--model",
    "mlp",
    "--steps",
    "40",
    "--checkpoint-every",
    "20",
    "--eval-every",
    "0",
    "--no-progress",
]
RESUMED += ["--threads", "1", "--batch-size", "16", "--workers", "2", *FEATURES]


def _killed_and_resumed_matches_uninterrupted(strategy: str, precision: str, tmp_path) -> None:
    resumed = [*RESUMED, "--precision", precision]
    run_cli("train", "--strategy", strategy, "--out", str(tmp_path / "full"), *resumed)
    cut = str(tmp_path / "cut")
    killed = run_cli(
        "train",
        "--strategy",
        strategy,
        "--out",
        cut,
        *resumed,
        env={"PARAMBOX_FAULT": "1:25:kill"},
        check=False,
    )
    assert killed.returncode != 0 and not (tmp_path / "cut" / "summary.json").exists()
    run_cli("train", "--strategy", strategy, "--out", cut, "--resume", *resumed)
    assert summary(tmp_path / "cut")["steps"] == 40
    cut_steps, full_steps = _step_records(tmp_path / "cut"), _step_records(tmp_path / "full")
    assert [r["lr"] for r in cut_steps] == [r["lr"] for r in full_steps]  # the schedule went on exactly
    assert [r["loss"] for r in cut_steps[20:]] == pytest.approx(
        [r["loss"] for r in full_steps[20:]], rel=1e-5
    )
    assert max_abs_diff(final_weights(tmp_path / "cut"), final_weights(tmp_path / "full")) <= 1e-6
    assert summary(tmp_path / "cut")["final_test_loss"] == pytest.approx(
        summary(tmp_path / "full")["final_test_loss"], rel=1e-5
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_weight_avg_with_every_feature_killed_and_resumed_ends_where_the_uninterrupted_run_ends(tmp_path):
    _killed_and_resumed_matches_uninterrupted("weight-avg", "bf16", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_allreduce_with_every_feature_killed_and_resumed_ends_where_the_uninterrupted_run_ends(tmp_path):
    """fp16 here (a loss scaler, its skipped steps and scale resumed exactly), bf16 for weight-avg."""
    _killed_and_resumed_matches_uninterrupted("allreduce", "fp16", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_same_through_parambox_train(tmp_path, monkeypatch):
    fields = dict(
        model="mlp", data="digits", strategy="weight-avg", workers=2, steps=40, checkpoint_every=20,
        eval_every=0, progress=False, threads=1, batch_size=16, grad_clip=1.0, grad_accum=4,
        precision="bf16", lr_schedule="cosine", warmup_steps=20,
    )  # fmt: skip
    full = parambox.train(out=str(tmp_path / "full"), **fields)
    monkeypatch.setenv("PARAMBOX_FAULT", "1:25:kill")
    with pytest.raises(RuntimeError):
        parambox.train(out=str(tmp_path / "cut"), **fields)
    monkeypatch.delenv("PARAMBOX_FAULT")
    resumed = parambox.train(out=str(tmp_path / "cut"), resume=True, **fields)
    assert resumed.steps == 40
    assert max_abs_diff(resumed.model.state_dict(), full.model.state_dict()) <= 1e-6
