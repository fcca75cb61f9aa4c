"""``hybrid`` (ShmCaffe-H): allreduce inside a group, EASGD between the groups' leaders through the box."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from parambox.errors import UserError
from parambox.runtime import dist as pbdist
from parambox.runtime.dist import free_port
from parambox.runtime.world import World
from parambox.strategies.base import Context
from parambox.strategies.hybrid import Hybrid, HybridOptions, build_groups
from tests.conftest import MPI_ENV, run_cli, summary
from tests.forked import fork_ranks

LR, STEPS, ALPHA = 0.125, 3, 0.5
W0 = torch.tensor([1.0, 2.0, -1.0, 0.5])
ROWS = [torch.tensor([[1.0, 0.0, 2.0, -1.0]]), torch.tensor([[0.0, 3.0, 1.0, 1.0]])]
# Group [0, 1] and group [2, 3] see the same two batches, swapped: equal group-mean gradients, so
# both groups follow the same path and the center after both exchanges is order-free.
BATCH_OF_RANK = [0, 1, 1, 0]


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # forked: stay out of the parent's OpenMP pool
    world = World(rank, 4, rank, 4, launcher="local", master_addr="127.0.0.1", master_port=port)
    pbdist.init_distributed(world, 20.0)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(W0)
    opt = lambda p: torch.optim.SGD(p, lr=LR)  # noqa: E731
    ctx = Context(world, model, opt, lambda model, batch: model(batch[0]).sum(), STEPS, 20.0)
    # "all": every rank runs exactly STEPS steps (by default a group that starts first runs on until
    # the steps of all add up, and its extra exchanges move the center on)
    strategy = Hybrid(ctx, HybridOptions(group_size=2, tau=STEPS, alpha=ALPHA, termination="all"))
    x = ROWS[BATCH_OF_RANK[rank]]
    step = 0
    while not strategy.should_stop(step):
        strategy.step((x, torch.zeros(1)), step)
        step += 1
    replica = strategy.x.tolist()
    strategy.finish()
    center = strategy.eval_model()
    out = {"replica": replica, "center": None if center is None else center.weight.flatten().tolist()}
    strategy.close()
    pbdist.destroy_distributed()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(out))


# Lazy imports (torch.optim pulls in torch._dynamo, ~1.5 s) happen once here, not in every child.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.timeout(90)
def test_hybrid_rule_allreduce_in_group_then_elastic_exchange_of_the_leaders(tmp_path):
    """K synchronous steps on the group-mean gradient, then each leader's d = alpha (x - c), x -= d,
    c += d, broadcast in the group. Both groups reach x = w0 - lr K g, so c = x - (1 - alpha)^2 (x - w0)
    when one leader's exchange follows the other's; asynchronous EASGD does not lock the center, so
    when both leaders read c = w0 before either pushed, c = w0 + 2 alpha (x - w0) (seen under load)."""
    fork_ranks(_worker, 4, (free_port(), str(tmp_path)), timeout=60)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    g = (ROWS[0] + ROWS[1]).flatten() / 2  # the group mean, not either member's own gradient
    x = W0 - LR * STEPS * g
    c1 = W0 + ALPHA * (x - W0)  # after the first leader's exchange
    center = torch.tensor(res[0]["center"])
    replicas = [torch.tensor(r["replica"]) for r in res]
    assert torch.equal(replicas[0], replicas[1]) and torch.equal(replicas[2], replicas[3])  # broadcast
    if torch.equal(center, W0 + 2 * ALPHA * (x - W0)):  # the two exchanges at once: both from w0
        assert torch.equal(replicas[0], x - ALPHA * (x - W0)) and torch.equal(replicas[2], replicas[0])
        return
    assert torch.equal(center, x - (1 - ALPHA) ** 2 * (x - W0))
    first, second = x - ALPHA * (x - W0), x - ALPHA * (x - c1)
    assert {tuple(replicas[0].tolist()), tuple(replicas[2].tolist())} == {
        tuple(first.tolist()),
        tuple(second.tolist()),
    }


def test_groups_and_options():
    assert build_groups(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(UserError, match="group_size=3"):
        build_groups(4, 3)
    with pytest.raises(ValidationError, match="sync"):  # not a field: hybrid is asynchronous between groups
        HybridOptions(sync=True)
    with pytest.raises(ValidationError, match="termination 'all'"):
        HybridOptions(termination="fastest")


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.long
def test_digits_4_workers_2_groups_over_the_rma_box_reaches_093(tmp_path):
    """The two groups talk only through MPI windows (osc rdma over tcp, the network path)."""
    out = tmp_path / "run"
    env = {**MPI_ENV, "OMPI_MCA_osc": "rdma", "OMPI_MCA_btl": "self,tcp"}
    args = ["--preset", "digits-hybrid", "--box", "rma", "--steps", "300", "--out", str(out), "--no-progress"]
    run_cli("train", *args, env=env)  # (half the preset's steps: 0.969 here)
    s = summary(out)
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
    assert s["workers"] == 4 and s["worker_steps"] == [300] * 4 and s["nonfinite_workers"] == []


@pytest.mark.parametrize(("field", "value"), [("compression", "int8"), ("overlap", True), ("sync", True)])
def test_easgds_exchange_options_are_not_hybrids_fields(field, value):
    """hybrid took EASGD's ``compression``, ``overlap`` and ``sync`` with its options and did none of them
    (a user's int8 sent float32, an overlap was silently ignored): they are not its fields, and the error
    names the field and the ones it has."""
    from parambox.config import build_config

    with pytest.raises(UserError) as e:
        build_config({"strategy": "hybrid", "options": {"hybrid": {field: value}}})
    assert str(e.value).startswith(f"config field 'hybrid.{field}' does not exist"), e.value
    assert "group_size" in str(e.value) and "tau" in str(e.value)


def test_alpha_and_rho_together_are_refused_in_one_line():
    from parambox.config import build_config

    with pytest.raises(UserError) as e:
        build_config({"strategy": "easgd", "options": {"easgd": {"alpha": 0.1, "rho": 1.0}}})
    assert str(e.value) == "easgd: give alpha or rho (alpha = lr * rho), not both"
