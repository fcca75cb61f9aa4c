"""Compressed and overlapped exchanges (issue 17, items 3 and 4).

Tier (a): the codecs' error bounds, error feedback, byte counts, and the delayed averager on plain
tensors. Tier (b): two gloo workers on loopback with constant gradients (the loss ``w . c_r``), so
every round's progress is known in advance: weight-avg, diloco and synchronous easgd, delayed or
not, compressed or not, end at their closed forms to 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from parambox.box import PREFIX_ENV, new_prefix
from parambox.errors import UserError
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies import build_strategy, strategy_class
from parambox.strategies.base import Context
from parambox.strategies.compress import Compressor, dequantize_int8, quantize_int8
from parambox.strategies.diloco import DilocoOptions
from parambox.strategies.exchange import DeltaAverager, SumExchange
from tests.conftest import final_weights, run_cli, summary
from tests.forked import fork_ranks

# -- tier (a) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 7, 256])
def test_int8_round_trip_is_within_half_a_step_per_block(block):
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-3, 2, 1000)
    codes, scales = quantize_int8(x, block)
    assert codes.dtype == torch.int8 and scales.numel() == -(-1000 // block)
    err = (dequantize_int8(codes, scales, block) - x).abs()
    bound = scales.repeat_interleave(block)[:1000] / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())


def test_int8_of_zeros_and_bf16_relative_error():
    assert Compressor("int8", 5).round_trip(torch.zeros(5)).tolist() == [0.0] * 5
    x = torch.randn(1000)
    y = Compressor("bf16", 1000, error_feedback=False).round_trip(x)
    assert float(((y - x).abs() / x.abs()).max()) <= 2**-8  # bf16 keeps 8 significant bits


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_error_feedback_keeps_the_cumulative_sum(mode):
    """Sum of what was sent - sum of what was meant = minus the residual the sender keeps: bounded
    by one message's error, however many rounds; without feedback the error grows with the rounds."""
    torch.manual_seed(1)
    xs = [torch.randn(512) * 1e-3 + 1e-4 for _ in range(200)]
    with_ef, without = Compressor(mode, 512, block=64), Compressor(mode, 512, block=64, error_feedback=False)
    sent = sum(with_ef.round_trip(x) for x in xs)
    sent_plain = sum(without.round_trip(x) for x in xs)
    meant = sum(xs)
    assert torch.allclose(sent + with_ef.error, meant, atol=1e-6)
    one_step = float((with_ef.round_trip(xs[0]) - xs[0]).abs().max()) + float(with_ef.error.abs().max())
    assert float((sent - meant).abs().max()) <= 2 * one_step
    assert float((sent - meant).abs().max()) < float((sent_plain - meant).abs().max())


def test_bytes_per_message():
    n = 1000
    assert Compressor("none", n).message_bytes(2) == 4 * n + 8
    assert Compressor("bf16", n).message_bytes(2) == 2 * n + 8
    assert Compressor("int8", n, block=256).message_bytes(2) == n + 4 * 4 + 8
    c = Compressor("int8", n, block=256)
    msg = c.encode(torch.randn(n), torch.tensor([1.0, 2.0]))
    assert msg.dtype == torch.uint8 and msg.numel() == c.message_bytes(2)
    x_hat, tail = c.decode(msg)
    assert tail.tolist() == [1.0, 2.0] and x_hat.shape == (n,)


def test_options_are_typed():
    assert DilocoOptions(overlap=True, compression="int8").compression == "int8"
    with pytest.raises(ValidationError):
        DilocoOptions(compression="fp8")
    with pytest.raises(ValidationError):
        DilocoOptions(compression_block=0)


def test_delayed_averager_applies_each_mean_one_round_late():
    """One rank, weight-avg's outer step (theta -= mean delta): the undelayed form restarts from theta
    at once; the delayed one keeps the round's progress and theta lags by one round."""
    theta0 = torch.zeros(3)
    undelayed = DeltaAverager(theta0.clone(), lambda m: None, SumExchange(3, 1, 1), False, 0)
    undelayed.outer_step = undelayed.theta.sub_
    delayed = DeltaAverager(theta0.clone(), lambda m: None, SumExchange(3, 1, 1), True, 0)
    delayed.outer_step = delayed.theta.sub_
    x_u, x_d = theta0.clone(), theta0.clone()
    for k in range(1, 4):
        x_u, x_d = x_u + 1.0, x_d + 1.0  # a round's progress: +1
        x_u = undelayed.round_end_(x_u)
        x_d = delayed.round_end_(x_d)
        assert torch.equal(undelayed.theta, torch.full((3,), float(k)))
        assert torch.equal(delayed.theta, torch.full((3,), float(k - 1)))  # one round late
        assert torch.equal(x_u, x_d)  # the replica carries its own progress meanwhile
    delayed.flush_()
    assert torch.equal(delayed.theta, undelayed.theta)


# -- tier (b): two gloo workers, constant gradients ---------------------------------------------------------

DIM, LR, STEPS, PERIOD = 300, 0.125, 22, 4
W0 = torch.linspace(-1, 1, DIM)
# Per-rank constant gradients; every value in a 64-block has the same magnitude, so int8 and bf16
# carry them exactly (powers of two) and the closed forms hold for every encoding.
SIGNS = torch.where(torch.arange(DIM) % 3 == 0, -1.0, 1.0)
GRADS = [SIGNS * 0.5, SIGNS * 0.25 * torch.where(torch.arange(DIM) % 2 == 0, 1.0, -1.0)]


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(W0.clone())


def _worker(rank: int, port: int, out: str, strategy: str, options: dict) -> None:
    torch.set_num_threads(1)
    world = World(rank, 2, rank, 2, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 30.0)
    try:
        model = Linear()
        ctx = Context(
            world, model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), STEPS, 30.0
        )
        s = build_strategy(strategy, ctx, strategy_class(strategy).Options(**options))
        waits, nbytes = [], []
        for step in range(STEPS):
            r = s.step(GRADS[rank], step)
            waits.append(r.extra.get("exchange_wait_s", -1.0))
            nbytes.append(r.extra.get("exchange_bytes", 0.0))
        s.finish()
        result = s.eval_model()
        w = (result if result is not None else model).w if strategy != "easgd" else None
        if strategy == "easgd" and result is not None:
            w = next(result.parameters())
        data = {"w": None if w is None else w.detach().tolist(), "waits": waits, "bytes": nbytes}
        s.close()
        Path(out, f"{rank}.json").write_text(json.dumps(data))
    finally:
        pbdist.destroy_distributed()


def run_two(tmp_path: Path, strategy: str, options: dict) -> list[dict]:
    fork_ranks(_worker, 2, (free_port(), str(tmp_path), strategy, options), timeout=120)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def diloco_closed_form(outer_lr: float, momentum: float) -> torch.Tensor:
    """Every full round moves a replica by -PERIOD LR g_r; the last partial round by its steps."""
    g = (GRADS[0] + GRADS[1]) / 2
    theta = nn.Parameter(W0.clone())
    outer = torch.optim.SGD([theta], lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    rounds = [PERIOD] * (STEPS // PERIOD) + ([STEPS % PERIOD] if STEPS % PERIOD else [])
    for h in rounds:
        theta.grad = h * LR * g
        outer.step()
    return theta.detach()


def easgd_closed_form(alpha: float) -> torch.Tensor:
    xs, c = [W0.clone(), W0.clone()], W0.clone()
    for step in range(STEPS):
        xs = [x - LR * g for x, g in zip(xs, GRADS)]
        if (step + 1) % PERIOD == 0:
            es = [x - c for x in xs]
            xs = [x - alpha * e for x, e in zip(xs, es)]
            c = c + alpha * (es[0] + es[1])
    return c


CASES = [
    ("weight-avg", {"period": PERIOD}),
    ("weight-avg", {"period": PERIOD, "overlap": True, "compression": "int8", "compression_block": 64}),
    ("diloco", {"inner_steps": PERIOD}),
    ("diloco", {"inner_steps": PERIOD, "overlap": True}),
    ("diloco", {"inner_steps": PERIOD, "overlap": True, "compression": "bf16"}),
    ("diloco", {"inner_steps": PERIOD, "compression": "int8", "compression_block": 64}),
    ("easgd", {"tau": PERIOD, "alpha": 0.25, "sync": True, "overlap": True}),
    ("easgd", {"tau": PERIOD, "alpha": 0.25, "sync": True, "compression": "bf16"}),
]

# Lazy imports (torch.optim pulls in torch._dynamo) happen once here, not in every child.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy,options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_two_workers_reach_the_closed_form(tmp_path, strategy, options):
    res = run_two(tmp_path, strategy, options)
    if strategy == "weight-avg":
        expected = diloco_closed_form(1.0, 0.0)
    elif strategy == "diloco":
        expected = diloco_closed_form(0.7, 0.9)
    else:
        expected = easgd_closed_form(0.25)
    w = torch.tensor(res[0]["w"])
    mode = options.get("compression", "none")
    # easgd sends x - c, not a constant progress: bf16 rounds it (error feedback bounds what is left)
    tol = 1e-6 if strategy != "easgd" or mode == "none" else 2**-8 * float(W0.abs().max())
    assert float((w - expected).abs().max()) <= tol
    if strategy != "easgd":  # every replica ends at the result
        assert torch.allclose(torch.tensor(res[1]["w"]), w, atol=1e-7)
    waits = res[0]["waits"]
    assert len(waits) == STEPS and min(waits) >= 0.0
    full = 4 * DIM + 4 * 2 * (strategy != "weight-avg" or "overlap" in options)
    sent = [b for b in res[0]["bytes"] if b > 0]
    assert len(sent) == STEPS // PERIOD
    if mode == "none":
        assert sent[0] >= 4 * DIM
    else:
        assert sent[0] < full * (0.55 if mode == "bf16" else 0.3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_async_diloco_one_worker_reaches_the_closed_form(overlap, monkeypatch):
    """One worker over the shm box (buffer 1: every arrival is a full Nesterov step), constant gradient:
    the overlapped form pushes the same pseudo-gradients one round later and ends at the same theta."""
    monkeypatch.setenv(PREFIX_ENV, new_prefix())
    model = Linear()
    ctx = Context(
        World(), model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), STEPS, 30.0
    )
    options = {"inner_steps": PERIOD, "asynchronous": True, "overlap": overlap, "dynamic_inner_steps": False}
    s = build_strategy("diloco", ctx, options)
    try:
        waits = [s.step(GRADS[0], step).extra["exchange_wait_s"] for step in range(STEPS)]
        s.finish()
        w = s.eval_model().w.detach()
    finally:
        s.close()
    g = GRADS[0]
    theta = nn.Parameter(W0.clone())
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True)
    for h in [PERIOD] * (STEPS // PERIOD) + [STEPS % PERIOD]:
        theta.grad = h * LR * g
        outer.step()
    assert float((w - theta.detach()).abs().max()) <= 1e-6
    assert min(waits) >= 0.0


def test_overlap_of_asynchronous_easgd_is_refused():
    ctx = Context(World(), Linear(), lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: m.w.sum(), 1, 5.0)
    with pytest.raises(UserError, match="easgd.overlap needs easgd.sync=true"):
        build_strategy("easgd", ctx, {"overlap": True})


@pytest.mark.timeout(120)
def test_metrics_show_the_wait_and_the_bytes_of_each_exchange(tmp_path):
    """The CLI as a user runs it: every step records exchange_wait_s, every exchange its bytes (int8
    with 256-element blocks: about a quarter of float32)."""
    out = tmp_path / "run"
    sets = [
        "--set",
        "weight-avg.period=5",
        "--set",
        "weight-avg.overlap=true",
        "--set",
        "weight-avg.compression=int8",
    ]
    run_cli(
        "train", "--strategy", "weight-avg", *sets, "--model", "mlp", "--steps", "20", "--workers", "2",
        "--eval-every", "0", "--no-progress", "--threads", "1", "--out", str(out),
    )  # fmt: skip
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 20 and all(r["exchange_wait_s"] >= 0 for r in steps)
    sent = [r["exchange_bytes"] for r in steps if "exchange_bytes" in r]
    numel = sum(p.numel() for p in final_weights(out).values())
    assert len(sent) == 4 and all(0.24 * 4 * numel < b < 0.27 * 4 * numel for b in sent)
    assert summary(out)["final_test_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overlapped_compressed_diloco_resumes_bit_for_bit(tmp_path):
    """A checkpoint with an exchange in flight (every 10 steps, rounds of 3) keeps its result, the
    theta, the round's start and the error feedback: the resumed run ends as the uninterrupted one."""
    sets = ["diloco.inner_steps=3", "diloco.overlap=true", "diloco.compression=int8"]
    args = [*(a for s in sets for a in ("--set", s)), *RESUME_ARGS]
    run_cli("train", "--out", str(tmp_path / "full"), *args)
    killed = run_cli(
        "train", "--out", str(tmp_path / "cut"), *args, env={"PARAMBOX_FAULT": "1:25:kill"}, check=False
    )
    assert killed.returncode != 0
    run_cli("train", "--out", str(tmp_path / "cut"), "--resume", *args)
    a, b = final_weights(tmp_path / "cut"), final_weights(tmp_path / "full")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


RESUME_ARGS = ["--strategy", "diloco", "--model", "mlp", "--steps", "40", "--checkpoint-every", "10"]
RESUME_ARGS += ["--eval-every", "0", "--no-progress", "--threads", "1", "--batch-size", "16"]
