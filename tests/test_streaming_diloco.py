"""Streaming DiLoCo (``diloco.fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``).

Must show (issue 51): with fragments, equal to its closed form (constant gradients, two workers, F = 2,
tau in {0, 1}, alpha in {0, 0.5, 1}: the parameter history step by step, to float tolerance), and with
F = 1, tau = 0, alpha = 0 equal to synchronous diloco. Here: two gloo workers run every case in one pair
of processes, each step's weights against :func:`reference` (the paper's update written out in plain
tensor arithmetic, its Nesterov step by hand); the same pair runs the streaming class at F = 1 against
the ``Diloco`` class, and a compressed case; a digits run through the CLI (slow).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from parambox.errors import UserError
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies import build_strategy, strategy_class
from parambox.strategies.base import Context
from parambox.strategies.compress import Compressor
from parambox.strategies.diloco import Diloco, DilocoOptions, StreamingDiloco
from parambox.strategies.streaming import cut
from tests.conftest import final_weights, run_cli, summary
from tests.forked import fork_ranks

DIM, LR, STEPS, H = 7, 0.125, 14, 4  # 7 elements: fragments of 3 and 4; 14 steps: a partial last round
OUTER_LR, MU = 0.7, 0.9
W0 = torch.linspace(-1, 1, DIM)
GRADS = [
    torch.tensor([0.5, -0.5, 0.5, 0.25, -0.5, 0.5, -0.25]),
    torch.tensor([0.25, 0.25, -0.5, 0.5, 0.5, -1.0, 0.5]),
]
CASES = [(2, tau, alpha) for tau in (0, 1) for alpha in (0.0, 0.5, 1.0)]


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(W0.clone())


def reference(fragments: int, tau: int, alpha: float, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s weights after every step, then at the end: Streaming DiLoCo (Douillard et al.
    2025) with plain SGD inner steps, two workers, written out. Fragment f (elements ``[a, b)``) sends
    ``theta - x_r`` after the steps t with ``t % H == H f // F``; tau steps later
    ``m <- mu m + d; theta <- theta - lr (d + mu m)`` with d the mean, and ``x_r <- alpha x_r + (1 -
    alpha) theta`` on the fragment. At the end: what is in flight lands, what was not sent is sent and
    applied, every worker ends at theta."""
    xs = [W0.double().clone(), W0.double().clone()]
    theta, m = W0.double().clone(), torch.zeros(DIM, dtype=torch.float64)
    bounds = [DIM * f // fragments for f in range(fragments + 1)]
    frags = [(bounds[f], bounds[f + 1], H * f // fragments) for f in range(fragments)]
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}
    last_send = [0] * fragments

    def send(f: int, t: int) -> None:
        a, b, _ = frags[f]
        in_flight[f] = (t + tau, sum(theta[a:b] - x[a:b] for x in xs) / 2)
        last_send[f] = t

    def land(f: int, mix: float) -> None:
        a, b, _ = frags[f]
        _, d = in_flight.pop(f)
        m[a:b] = MU * m[a:b] + d
        theta[a:b] -= OUTER_LR * (d + MU * m[a:b])
        for x in xs:
            x[a:b] = mix * x[a:b] + (1 - mix) * theta[a:b]

    history = []
    for t in range(1, STEPS + 1):
        for r, x in enumerate(xs):
            x -= LR * GRADS[r].double()
        for f, (_, _, offset) in enumerate(frags):
            if t % H == offset:
                send(f, t)
        for f in list(in_flight):
            if in_flight[f][0] == t:
                land(f, alpha)
        history.append(xs[rank].clone())
    for f in list(in_flight):
        land(f, alpha)
    for f in range(fragments):
        if last_send[f] < STEPS:
            send(f, STEPS)
            land(f, 0.0)
    history.append(theta.clone())
    return history


def _run(strategy_cls: type, rank: int, world: World, options: dict) -> dict:
    model = Linear()
    ctx = Context(
        world, model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), STEPS, 30.0
    )
    opts = DilocoOptions(inner_steps=H, **options)
    s = strategy_cls(ctx, opts) if strategy_cls is not None else build_strategy("diloco", ctx, opts)
    ws, nbytes = [], []
    for step in range(STEPS):
        r = s.step(GRADS[rank], step)
        ws.append(model.w.detach().tolist())
        nbytes.append(r.extra.get("exchange_bytes", 0.0))
    s.finish()
    ws.append(model.w.detach().tolist())
    state = s.state_dict()
    s.close()
    return {"w": ws, "bytes": nbytes, "kind": type(s).__name__, "state_keys": sorted(state)}


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    world = World(rank, 2, rank, 2, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 30.0)
    try:
        data = {}
        for f, tau, alpha in CASES:
            opts = {"fragments": f, "fragment_sync_delay": tau, "fragment_update_alpha": alpha}
            data[f"{f}-{tau}-{alpha}"] = _run(None, rank, world, opts)
        data["sync"] = _run(Diloco, rank, world, {})
        data["streaming-1"] = _run(StreamingDiloco, rank, world, {})
        data["int8"] = _run(
            None, rank, world, {"fragments": 2, "compression": "int8", "compression_block": 2}
        )
        Path(out, f"{rank}.json").write_text(json.dumps(data))
    finally:
        pbdist.destroy_distributed()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("streaming")
    fork_ranks(_worker, 2, (free_port(), str(out)), timeout=240)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


# Lazy imports (torch.optim pulls in torch._dynamo) happen once here, not in every child.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fragments,tau,alpha", CASES)
def test_two_workers_follow_the_closed_form_step_by_step(runs, fragments, tau, alpha):
    for rank in range(2):
        got = torch.tensor(runs[rank][f"{fragments}-{tau}-{alpha}"]["w"], dtype=torch.float64)
        expected = torch.stack(reference(fragments, tau, alpha, rank))
        assert got.shape == expected.shape == (STEPS + 1, DIM)
        err = (got - expected).abs().max(dim=1).values
        assert float(err.max()) <= 1e-5, (rank, err.tolist())
        assert runs[rank][f"{fragments}-{tau}-{alpha}"]["kind"] == "StreamingDiloco"
    # the cases differ: alpha and tau change the history (the reference is not blind to them)
    assert not torch.allclose(torch.stack(reference(2, tau, 0.0, 0)), torch.stack(reference(2, tau, 1.0, 0)))
    if alpha < 1:  # with alpha 1 the replica keeps its own fragment: when theta moves shows only at the end
        assert not torch.allclose(
            torch.stack(reference(2, 0, alpha, 0)), torch.stack(reference(2, 1, alpha, 0))
        )


@pytest.mark.timeout(150)
def test_one_fragment_no_delay_no_mixing_is_synchronous_diloco(runs):
    for rank in range(2):
        sync, streaming = runs[rank]["sync"], runs[rank]["streaming-1"]
        assert sync["kind"] == "Diloco" and streaming["kind"] == "StreamingDiloco"
        assert sync["w"] == streaming["w"]  # every step, bit for bit
        assert torch.allclose(
            torch.tensor(sync["w"], dtype=torch.float64), torch.stack(reference(1, 0, 0.0, rank)), atol=1e-5
        )
    # the options route F = 1, tau = 0, alpha = 0 to the Diloco class itself
    assert Diloco.resolve(DilocoOptions()) is Diloco
    assert Diloco.resolve(DilocoOptions(inner_steps=4, fragments=2)) is StreamingDiloco


@pytest.mark.timeout(150)
def test_each_exchange_carries_one_fragment(runs):
    """Fragments of 3 and 4 elements: each exchange sends one of them (float32 plus two flags), alternating
    every H / F = 2 steps; int8 sends each fragment's own message."""
    sent = runs[0]["2-0-0.0"]["bytes"]
    steps = [i + 1 for i, b in enumerate(sent) if b > 0]
    assert steps == [2, 4, 6, 8, 10, 12, 14]
    sizes = {f.offset: f.numel for f in cut(DIM, 2, H)}  # offset 0: 3 elements, offset 2: 4
    assert [sent[t - 1] for t in steps] == [4.0 * (sizes[t % H] + 2) for t in steps]
    int8 = runs[0]["int8"]["bytes"]  # each fragment its own message: its codes, its scales, the flags
    coded = {o: Compressor("int8", n, block=2).message_bytes(tail=2) for o, n in sizes.items()}
    assert [int8[t - 1] for t in steps] == [float(coded[t % H]) for t in steps]
    # compressed per fragment, with error feedback: the end is near the uncompressed one
    end = torch.tensor(runs[0]["int8"]["w"][-1])
    assert float((end - torch.tensor(runs[0]["2-0-0.0"]["w"][-1])).abs().max()) < 0.05
    assert "fragments" in runs[0]["2-0-0.0"]["state_keys"] and "theta" in runs[0]["2-0-0.0"]["state_keys"]


def test_options_are_checked():
    with pytest.raises(ValueError, match="fragments must be at most"):
        DilocoOptions(inner_steps=4, fragments=5)
    with pytest.raises(ValueError, match="fragment_sync_delay must be below"):
        DilocoOptions(inner_steps=4, fragment_sync_delay=4)
    with pytest.raises(ValueError):
        DilocoOptions(fragment_update_alpha=1.5)
    with pytest.raises(UserError, match="exclusive"):
        strategy_class("diloco").resolve(DilocoOptions(fragments=2, overlap=True))
    with pytest.raises(UserError, match="quorum's outer step and Streaming DiLoCo"):
        strategy_class("diloco").resolve(DilocoOptions(fragment_sync_delay=1, asynchronous=True, quorum=2))


def test_a_checkpoint_keeps_the_exchange_in_flight():
    """One worker, tau = 2: a state_dict taken while a fragment's exchange is in flight, loaded into a
    fresh strategy, lands the same outer step at the same step as the original."""

    def make() -> tuple[Linear, StreamingDiloco]:
        model = Linear()
        ctx = Context(
            World(), model, lambda p: torch.optim.SGD(p, lr=LR), lambda m, b: (m.w * b).sum(), 12, 30.0
        )
        opts = DilocoOptions(inner_steps=H, fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.5)
        return model, StreamingDiloco(ctx, opts)

    model, s = make()
    for step in range(5):  # fragment 0 sent after step 4 (t = 4), lands after t = 6
        s.step(GRADS[0], step)
    buf = io.BytesIO()  # as a checkpoint: saved and loaded, nothing shared with the running strategy
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    weights = model.w.detach().clone()
    assert state["fragments"][0]["land_after"] == 6 and "pending" in state["fragments"][0]
    model2, s2 = make()
    with torch.no_grad():
        model2.w.copy_(weights)
    s2.load_state_dict(state)
    for step in range(5, 12):
        s.step(GRADS[0], step)
        s2.step(GRADS[0], step)
        assert torch.equal(model.w, model2.w), step
    s.finish()
    s2.finish()
    assert torch.equal(model.w, model2.w)
    s.close()
    s2.close()


FAST = ["--model", "mlp", "--eval-every", "0", "--no-progress", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_digits_with_two_fragments_reaches_the_default_accuracy(tmp_path):
    """The digits-diloco preset (AdamW 1e-3, H 10, 600 steps, 2 workers) with fragments=2, a one-step
    delay and the paper's mix alpha 0.5 (the guide's command): >= 0.95 as the preset; each exchange
    carries half the model. Measured at seeds 0-2: 0.961-0.967; with alpha 0 (torchft's default)
    0.947-0.969, below the bar at seeds 0 and 1 (0.9499, 0.947)."""
    out = tmp_path / "run"
    sets = ["--set", "diloco.fragments=2", "--set", "diloco.fragment_sync_delay=1"]
    sets += ["--set", "diloco.fragment_update_alpha=0.5"]
    run_cli(
        "train", "--preset", "digits-diloco", *sets, "--eval-every", "0", "--out", str(out), "--no-progress"
    )
    s = summary(out)
    assert s["final_test_accuracy"] >= 0.95, s["final_test_accuracy"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sent = [r["exchange_bytes"] for r in rows if r.get("exchange_bytes")]
    assert sent and max(sent) < 0.55 * 2 * min(sent) + 64


RESUME_ARGS = ["--strategy", "diloco", "--model", "mlp", "--steps", "40", "--checkpoint-every", "10"]
RESUME_ARGS += ["--eval-every", "0", "--no-progress", "--threads", "1", "--batch-size", "16"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_streaming_diloco_resumes_bit_for_bit(tmp_path):
    """H 4, two fragments, tau 1: the checkpoint after step 10 is taken with fragment 1's exchange in flight
    (sent after t = 10, landing after t = 11); with its result, theta, the outer momenta and the int8
    error feedback kept, the run killed at step 25 and resumed ends as the uninterrupted one."""
    sets = [
        "inner_steps=4",
        "fragments=2",
        "fragment_sync_delay=1",
        "fragment_update_alpha=0.5",
        "compression=int8",
    ]
    args = [*(a for s in sets for a in ("--set", f"diloco.{s}")), *RESUME_ARGS]
    run_cli("train", "--out", str(tmp_path / "full"), *args)
    killed = run_cli(
        "train", "--out", str(tmp_path / "cut"), *args, env={"PARAMBOX_FAULT": "1:25:kill"}, check=False
    )
    assert killed.returncode != 0
    run_cli("train", "--out", str(tmp_path / "cut"), "--resume", *args)
    a, b = final_weights(tmp_path / "cut"), final_weights(tmp_path / "full")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
