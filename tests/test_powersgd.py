"""Compressed gradients of allreduce, and PowerSGD (issue 51, item 2).

Tier (a): PowerSGD on plain tensors: exact on a matrix of rank r, its error feedback's closed form (what
was sent plus what every rank still owes is the sum of the gradients) over two ranks in threads, its
bytes, the options. Tier (b): two gloo workers on loopback, a tiny MLP, allreduce with int8, topk and
powersgd: every rank ends with the same weights, the same closed form holds for the gradients the
optimizer saw, and each step sends the stated bytes, and a strategy rebuilt from its state mid-run ends where it would have. Tier (c): the CLI on digits.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from parambox.errors import UserError
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies import build_strategy, strategy_class
from parambox.strategies.allreduce import AllReduceOptions
from parambox.strategies.base import Context
from parambox.strategies.compress import Compressor
from parambox.strategies.diloco import DilocoOptions
from parambox.strategies.powersgd import PowerSGD
from tests.conftest import run_cli, summary

# -- tier (a) ---------------------------------------------------------------------------------------------


class Threads:
    """An in-place sum over ``n`` threads (one per rank), standing in for ``all_reduce``."""

    def __init__(self, n: int):
        self.barrier, self.parts = threading.Barrier(n), [None] * n

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()
            t.copy_(total)

        return reduce


def test_a_matrix_of_rank_r_is_carried_exactly():
    torch.manual_seed(1)
    m = torch.randn(20, 2) @ torch.randn(2, 10)  # rank 2
    ps = PowerSGD([m.shape], rank=2)
    total, _ = ps.reduce(m.reshape(-1), torch.zeros(0), lambda t: None, 1)
    assert torch.allclose(total, m.reshape(-1), atol=1e-5)
    assert float(ps.error.abs().max()) < 1e-5
    m3 = m + torch.outer(torch.randn(20), torch.randn(10))  # rank 3 at rank 2: not exact
    assert float(PowerSGD([m.shape], rank=2).reduce(m3.reshape(-1), torch.zeros(0), lambda t: None, 1)[0].sub(m3.reshape(-1)).abs().max()) > 1e-2  # fmt: skip


def test_what_is_not_sent_is_sent_later_over_two_ranks():
    """Two ranks, 12 rounds of random gradients (two matrices, a bias): every rank decodes the same sum,
    and sum over rounds of the decoded sums + both ranks' errors = sum of every rank's gradients."""
    torch.manual_seed(2)
    shapes = [torch.Size([16, 12]), torch.Size([16]), torch.Size([8, 4, 3])]
    numel = sum(s.numel() for s in shapes)
    rounds, group = 12, Threads(2)
    xs = [[torch.randn(numel) for _ in range(rounds)] for _ in range(2)]
    coders = [PowerSGD(shapes, rank=1) for _ in range(2)]
    sent: list[list[torch.Tensor]] = [[], []]

    def rank(r: int) -> None:
        for x in xs[r]:
            total, tail = coders[r].reduce(x, torch.ones(1), group.all_reduce(r), 2)
            assert tail.tolist() == [2.0]
            sent[r].append(total)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(a, b) for a, b in zip(*sent))  # the same on both ranks
    meant = torch.stack(xs[0] + xs[1]).sum(0)
    owed = coders[0].error + coders[1].error
    assert float(owed.abs().max()) > 0.1  # something is owed: the test can fail
    assert torch.allclose(torch.stack(sent[0]).sum(0) + owed, meant, atol=1e-4)
    bias = slice(192, 208)
    assert torch.equal(owed[bias], torch.zeros(16))  # vectors go whole
    assert coders[0].bytes_sent == coders[0].message_bytes(tail=1) == 4 * ((16 + 12) + 16 + (8 + 12) + 1)


def test_small_matrices_go_whole_and_q_is_shared():
    ps = PowerSGD([torch.Size([4, 3]), torch.Size([64, 32])], rank=4)
    assert [(rows, cols) for _, rows, cols in ps.matrices] == [(64, 32)]  # (4 + 3) 4 * 2 > 12
    assert ps.message_bytes(tail=0) == 4 * (12 + (64 + 32) * 4)
    assert torch.equal(ps.qs[0], PowerSGD([torch.Size([64, 32])], rank=4).qs[0])  # the same seed


def test_options():
    assert AllReduceOptions(compression="powersgd", powersgd_rank=2).powersgd_rank == 2
    with pytest.raises(ValidationError, match="powersgd_rank"):
        AllReduceOptions(compression="powersgd", powersgd_rank=0)
    with pytest.raises(ValidationError, match="(?s)compression.*allreduce"):
        strategy_class("easgd").Options(compression="powersgd")


# -- tier (b): two gloo workers, a tiny MLP -------------------------------------------------------------------

STEPS, LR = 8, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))


def _train(world: World, options: dict, resume_at: int | None = None, keep: bool = True) -> dict:
    """STEPS steps of allreduce (or ``options["strategy"]``); with ``resume_at`` the strategy is rebuilt after that step from its
    state (``keep``: with its compression state, as a checkpoint holds it; else without)."""
    rank = world.rank
    model = _model()
    params = list(reversed(list(model.parameters())))  # the buckets' order
    raw = torch.zeros(sum(p.numel() for p in params))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = (m(x) - x[:, :6].sin()).pow(2).mean()
        grads = torch.autograd.grad(loss, params, retain_graph=True)  # this rank's own gradient
        raw.add_(torch.cat([g.reshape(-1) for g in grads]))
        return loss

    options = dict(options)
    name = options.pop("strategy", "allreduce")
    accum = options.pop("grad_accum", 1)  # and a clip that never bites: the norm it saw is recorded
    ctx = Context(world, model, lambda p: torch.optim.SGD(p, lr=LR), loss_fn, STEPS, 30.0)
    ctx.grad_accum, ctx.grad_clip = accum, 1e6 if accum > 1 else None
    s = build_strategy(name, ctx, strategy_class(name).Options(**options))
    applied, nbytes, norms = torch.zeros_like(raw), [], []
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(STEPS):
        r = s.step(torch.randn(16, 12, generator=gen), step)
        grad = torch.cat([p.grad.reshape(-1) for p in params])  # the averaged gradient
        applied += grad
        nbytes.append(r.extra.get("exchange_bytes", 0.0))
        norms.append([r.extra.get("grad_norm", 0.0), float(grad.norm())])
        if step == resume_at:
            state = s.state_dict()
            if not keep:
                owed = state["compression"] if name == "allreduce" else state["averager"]
                owed.pop("error"), owed.pop("q", None)
            s.close()
            s = build_strategy(name, ctx, strategy_class(name).Options(**options))
            s.load_state_dict(state)
    error = s.state_dict()["compression" if name == "allreduce" else "averager"]["error"]
    s.close()
    return {
        "w": torch.cat([p.detach().reshape(-1) for p in params]).tolist(),
        "raw": (raw / accum).tolist(),  # each micro-batch's loss counts 1 / accum
        "norms": norms,
        "applied": applied.tolist(),
        "error": error.tolist(),
        "bytes": nbytes,
    }


def _worker(rank: int, port: int, out: str, options: dict) -> None:
    torch.set_num_threads(1)
    world = World(rank, 2, rank, 2, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 30.0)
    try:
        data = _train(world, options)
        data["w_resumed"] = _train(world, options, resume_at=3)["w"]
        data["w_forgot"] = _train(world, options, resume_at=3, keep=False)["w"]
        Path(out, f"{rank}.json").write_text(json.dumps(data))
    finally:
        pbdist.destroy_distributed()


def run_two(tmp_path: Path, options: dict) -> list[dict]:
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), options)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


NUMEL = 12 * 32 + 32 + 32 * 6 + 6  # 614
FLAGS = 4
CASES = {
    "int8": (
        {"compression": "int8", "compression_block": 64},
        Compressor("int8", NUMEL, 64).message_bytes(FLAGS),
    ),
    "topk": ({"compression": "topk", "compression_ratio": 0.05}, 8 * 31 + 4 * FLAGS),
    # the 32 x 12 and 6 x 32 matrices at rank 2, the biases whole
    "powersgd": (
        {"compression": "powersgd", "powersgd_rank": 2},
        4 * ((32 + 12) * 2 + (6 + 32) * 2 + 32 + 6 + FLAGS),
    ),
}
# two micro-batches a step: one exchange a step, after the last backward, before the clipping
CASES["powersgd-accum"] = ({**CASES["powersgd"][0], "grad_accum": 2}, CASES["powersgd"][1])  # fmt: skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", list(CASES))
def test_two_workers_agree_owe_what_they_did_not_send_and_resume(tmp_path, mode):
    options, stated = CASES[mode]
    res = run_two(tmp_path, {**options, "bucket_mb": 0.001, "first_bucket_mb": 0.001})  # several buckets
    # rebuilt from its state after step 3 (as from a checkpoint), it ends where it would have: the error
    # feedback (and PowerSGD's Q) are in the state; without them it does not
    assert res[0]["w"] == res[1]["w"]  # every rank decoded the same sum
    assert res[0]["w_resumed"] == res[0]["w"]
    assert res[0]["w_forgot"] != res[0]["w"]
    assert res[0]["applied"] == res[1]["applied"]
    raw = torch.tensor(res[0]["raw"]) + torch.tensor(res[1]["raw"])
    owed = torch.tensor(res[0]["error"]) + torch.tensor(res[1]["error"])
    assert float(owed.abs().max()) > 1e-4  # not everything was sent
    # sum of the averaged gradients * 2 + what both still owe = sum of both ranks' own gradients
    assert torch.allclose(2 * torch.tensor(res[0]["applied"]) + owed, raw, atol=1e-4)
    assert res[0]["bytes"] == [float(stated)] * STEPS
    assert stated < 0.6 * 4 * (NUMEL + FLAGS)
    if "grad_accum" in options:  # the clipping saw the averaged, decompressed gradient, on both ranks
        seen = [[n[0] for n in r["norms"]] for r in res]
        assert seen[0] == seen[1]
        assert seen[0] == pytest.approx([n[1] for n in res[0]["norms"]], rel=1e-5)


@pytest.mark.timeout(90)
def test_two_diloco_workers_send_low_rank_outer_gradients(tmp_path):
    """diloco with powersgd (rounds of 2 steps): the same theta on both ranks, the stated bytes at each
    round's end (the two matrices at rank 2, the biases and two flags whole), resumed as uninterrupted."""
    options = {"strategy": "diloco", "inner_steps": 2, "compression": "powersgd", "powersgd_rank": 2}
    res = run_two(tmp_path, options)
    assert res[0]["w"] == res[1]["w"]
    assert res[0]["w_resumed"] == res[0]["w"] and res[0]["w_forgot"] != res[0]["w"]
    stated = 4 * ((32 + 12) * 2 + (6 + 32) * 2 + 32 + 6 + 2)
    assert res[0]["bytes"] == [0.0, float(stated)] * (STEPS // 2)
    assert float(torch.tensor(res[0]["error"]).abs().max()) > 1e-5


def test_powersgd_where_it_cannot_go_is_refused():
    for options in ({"overlap": True}, {"asynchronous": True}, {"fragments": 2}):
        with pytest.raises(UserError, match="diloco.compression=powersgd"):
            strategy_class("diloco").resolve(DilocoOptions(compression="powersgd", **options))
    with pytest.raises(ValidationError, match="(?s)compression.*allreduce"):
        strategy_class("weight-avg").Options(compression="powersgd")


# -- tier (c): the CLI --------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_cli_trains_allreduce_with_powersgd(tmp_path):
    out = tmp_path / "run"
    run_cli(
        "train", "--strategy", "allreduce", "--set", "allreduce.compression=powersgd",
        "--set", "allreduce.powersgd_rank=2", "--model", "mlp", "--steps", "60", "--workers", "2",
        "--eval-every", "0", "--no-progress", "--threads", "1", "--out", str(out),
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sent = [r["exchange_bytes"] for r in rows if r["kind"] == "step" and "exchange_bytes" in r]
    assert len(sent) == 60 and len(set(sent)) == 1
    assert summary(out)["final_test_accuracy"] > 0.5


def test_cli_refuses_powersgd_where_it_does_not_apply(tmp_path):
    proc = run_cli(
        "train", "--strategy", "weight-avg", "--set", "weight-avg.compression=powersgd", "--steps", "2",
        "--out", str(tmp_path / "run"), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "compression" in proc.stderr and "Traceback" not in proc.stderr
