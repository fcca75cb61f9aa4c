"""Asynchronous Streaming DiLoCo (``diloco.asynchronous=true`` with ``fragments``, ``fragment_sync_delay``,
``fragment_update_alpha``): each fragment of the center an asynchronous DiLoCo of its own over the box.

Closed form: one worker, where Delayed Nesterov with N = 1 is Nesterov SGD, so the asynchronous form's
history is synchronous Streaming DiLoCo's (``StreamingDiloco``, itself checked against the paper's
update written out in tests/test_streaming_diloco.py), step by step: F = 2 and 3, tau in {0, 1}, alpha in
{0, 0.5, 1}, and with int8 error feedback. Over the rma box's memory server (the outer step applied
there, per fragment) the same, under mpiexec. Then two workers through the CLI as a user runs it.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from parambox.errors import UserError
from parambox.runtime.world import World
from parambox.strategies import strategy_class
from parambox.strategies.base import Context
from parambox.strategies.diloco import AsyncStreamingDiloco, DilocoOptions, StreamingDiloco
from tests.conftest import MPI_ENV, final_weights, run_cli, summary

DIM, LR, STEPS, H = 7, 0.125, 14, 4  # 7 elements: fragments of 3 and 4 (or 2, 2, 3); a partial last round
W0 = torch.linspace(-1, 1, DIM)
GRAD = torch.tensor([0.5, -0.5, 0.5, 0.25, -0.5, 0.5, -0.25])
CASES = [(f, tau, alpha) for f in (2, 3) for tau in (0, 1) for alpha in (0.0, 0.5, 1.0)]
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(W0.clone())


def history(cls: type, options: dict, steps: int = STEPS, box: object = None) -> list[list[float]]:
    """The weights after every step, then the run's result (the center, or theta): one worker."""
    model = Linear()
    kw = {"box": box} if box is not None else {}
    ctx = Context(
        World(), model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), steps, 30.0, **kw
    )
    s = cls(ctx, DilocoOptions(inner_steps=H, **options))
    ws = []
    for step in range(steps):
        s.step(GRAD * (1 + step % 3), step)  # not constant: each fragment's history depends on when it goes
        ws.append(model.w.detach().tolist())
    s.finish()
    result = s.eval_model() if isinstance(s, AsyncStreamingDiloco) else model
    ws.append(result.w.detach().tolist())
    s.close()
    return ws


@pytest.mark.parametrize("fragments, tau, alpha", CASES)
def test_one_worker_is_synchronous_streaming_diloco_step_by_step(fragments, tau, alpha):
    opts = {"fragments": fragments, "fragment_sync_delay": tau, "fragment_update_alpha": alpha, **OUTER}
    want = history(StreamingDiloco, opts)
    got = history(AsyncStreamingDiloco, {**opts, "asynchronous": True})
    assert len(got) == len(want) == STEPS + 1
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, abs=1e-6), step


def test_one_worker_with_int8_error_feedback_per_fragment_is_the_synchronous_form():
    opts = {"fragments": 2, "fragment_sync_delay": 1, "compression": "int8", "compression_block": 2, **OUTER}
    want = history(StreamingDiloco, opts)
    got = history(AsyncStreamingDiloco, {**opts, "asynchronous": True})
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, abs=1e-6), step


def test_the_options_resolve_to_the_asynchronous_streaming_form_and_a_quorum_is_refused():
    diloco = strategy_class("diloco")
    assert diloco.resolve(DilocoOptions(fragments=2, asynchronous=True)) is AsyncStreamingDiloco
    assert diloco.resolve(DilocoOptions(fragment_sync_delay=1, asynchronous=True)) is AsyncStreamingDiloco
    with pytest.raises(UserError, match="quorum's outer step and Streaming DiLoCo"):
        diloco.resolve(DilocoOptions(fragments=2, asynchronous=True, quorum=2))
    with pytest.raises(UserError, match="exclusive"):
        diloco.resolve(DilocoOptions(fragments=2, asynchronous=True, overlap=True))


def test_a_checkpoint_keeps_each_fragments_exchange_in_flight():
    """tau = 2: a state_dict taken while fragment 1's exchange is in flight (sent after step 6, landing
    after step 8), saved and loaded into a fresh wrap over a fresh box, ends as the run never stopped."""
    opts = DilocoOptions(
        inner_steps=H,
        fragments=2,
        fragment_sync_delay=2,
        fragment_update_alpha=0.5,
        asynchronous=True,
        **OUTER,
    )

    def make() -> tuple[Linear, AsyncStreamingDiloco]:
        model = Linear()
        ctx = Context(
            World(), model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), 12, 30.0
        )
        return model, AsyncStreamingDiloco(ctx, opts)

    def steps(s: AsyncStreamingDiloco, first: int, stop: int) -> None:
        for step in range(first, stop):
            s.step(GRAD * (1 + step % 3), step)

    def result(s: AsyncStreamingDiloco) -> torch.Tensor:
        s.finish()
        w = s.eval_model().w.detach().clone()
        s.close()
        return w

    _, whole = make()
    steps(whole, 0, 12)
    want = result(whole)
    model, s = make()
    steps(s, 0, 7)
    buf = io.BytesIO()  # as a checkpoint: saved and loaded, nothing shared with the running strategy
    torch.save(s.state_dict(), buf)
    weights = model.w.detach().clone()
    s.close()
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    assert state["fragments"][1]["land_in"] == 1 and "incoming" in state["fragments"][1]
    assert state["fragments"][0]["land_in"] is None and len(state["tickets"]) == 2
    model, s = make()
    with torch.no_grad():
        model.w.copy_(weights)
    s.load_state_dict(state)
    steps(s, 7, 12)
    assert result(s).tolist() == pytest.approx(want.tolist(), abs=1e-7)


ONE = ["--model", "logreg", "--workers", "1", "--steps", "30", "--eval-every", "0", "--no-progress"]
ONE += ["--threads", "1", "--seed", "3"]
STREAM = ["inner_steps=4", "fragments=2", "fragment_sync_delay=1", "fragment_update_alpha=0.5"]
STREAM += ["outer_momentum=0.9"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_over_the_memory_server_one_worker_is_the_synchronous_form(tmp_path):
    """``--box rma --set box.server=true``: one worker and the memory rank that holds the box and applies
    each fragment's outer step (``outer_step_async`` at the fragment's start); the run ends at the weights
    of synchronous Streaming DiLoCo's run of one worker on the same data, to float tolerance."""
    sets = [a for s in STREAM for a in ("--set", f"diloco.{s}")]
    run_cli("train", "--strategy", "diloco", *sets, *ONE, "--out", str(tmp_path / "sync"))
    sets += ["--set", "diloco.asynchronous=true", "--box", "rma", "--set", "box.server=true"]
    run_cli("train", "--strategy", "diloco", *sets, *ONE, "--out", str(tmp_path / "async"), env=MPI_ENV)
    s = summary(tmp_path / "async")
    assert s["memory_ranks"] == 1 and s["worker_steps"] == [30], s
    a, b = final_weights(tmp_path / "async"), final_weights(tmp_path / "sync")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float(b[k].abs().max()) for k in b) > 0.01  # (it trained)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_train_digits_with_fragments_as_a_user_types_it(tmp_path):
    """The user's command: ``--set diloco.asynchronous=true --set diloco.fragments=2`` on the defaults
    (600 steps, 2 workers, the shm box): the diloco default's accuracy, and each push carries a fragment."""
    out = tmp_path / "run"
    sets = ["--set", "diloco.asynchronous=true", "--set", "diloco.fragments=2"]
    run_cli("train", "--strategy", "diloco", *sets, "--eval-every", "0", "--out", str(out), "--no-progress")
    s = summary(out)
    assert s["final_test_accuracy"] >= 0.95, s["final_test_accuracy"]
    assert s["worker_steps"] == [600, 600]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sent = [r["exchange_bytes"] for r in rows if r.get("exchange_bytes")]
    whole = 4 * sum(t.numel() for t in final_weights(out).values() if t.is_floating_point())
    assert sent and sorted(sent)[len(sent) // 2] == pytest.approx(whole / 2, rel=0.01), (sent[:8], whole)
