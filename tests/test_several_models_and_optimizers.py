"""Several models or optimizers in one loop.

Two models (a GAN), each in its own DistributedOptimizer: the generator's backward goes
through the discriminator, whose gradients the loop then zeroes mid-step, with ``optD.zero_grad()`` or
the module's ``D.zero_grad()`` (``.grad = None``, as PyTorch's DCGAN example writes it). Before, a
rule with ``.grad`` views added the dropped gradient back (allreduce, and every rule reading its flat
buffer: a silently different model), ps-sync and box-sync refused the loop with an error about
micro-steps, and two dogwild optimizers crossed their messages on the default group.

One model, two optimizers (Muon for the matrices, AdamW for the rest) given as a list: before, only one
optimizer was taken, and a second DistributedOptimizer on the same model ran (allreduce) or stopped with
an error about a moved model (easgd)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import parambox
from parambox.errors import UserError
from parambox.strategies import STRATEGIES, strategy_class
from tests.several_worker import gan, muon_adamw, zero_adamw

ROOT = Path(__file__).resolve().parents[1]
DATA_PARALLEL = [
    n
    for n in STRATEGIES
    if not strategy_class(n).owns_forward_backward and strategy_class(n).max_workers != 1
]
# One process, the whole batch: these rules are plain SGD on it
PLAIN_ALONE = ["allreduce", "ps-sync", "box-sync", "weight-avg", "single"]


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- tier (a): one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_a_module_zero_grad_mid_step_equals_the_optimizers(strategy):
    """D.zero_grad() (drops the .grad views) gives what optD.zero_grad() gives, on every rule: the
    gradient made after the drop is the step's, not added to the one thrown away."""
    freeze = strategy == "box-sync"  # it exchanges once per step: the generator's backward must not train D
    by_opt = gan(strategy, "opt", freeze)
    assert diff(gan(strategy, "module", freeze), by_opt) == 0.0
    if strategy in PLAIN_ALONE:
        assert diff(by_opt, gan(None)) <= 1e-6


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync"])
def test_the_dcgan_examples_two_backward_passes_after_a_module_zero_grad(strategy):
    """PyTorch's DCGAN loop: ``D.zero_grad()``, the real and the fake loss in two backward passes, each
    exchanged as DDP exchanges them (two ranks: tier b)."""
    assert diff(gan(strategy, "module", two_passes=True), gan(None, two_passes=True)) <= 1e-6


@pytest.mark.parametrize("zero", ["opt", "module"])
def test_box_sync_names_the_second_exchange_of_a_step_and_the_remedy(zero):
    with pytest.raises(
        UserError, match=r"box-sync exchanges a step's gradients once.*requires_grad_\(False\)"
    ):
        gan("box-sync", zero)


# -- tier (b): two ranks under torchrun -----------------------------------------------------------------


def torchrun(out: Path, strategy: str, zero: str, freeze: bool = False, two_passes: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="pb-torchrun-") as logs:
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--log-dir",
            logs,
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "several_worker.py"),
            strategy,
            str(out),
            zero,
            str(int(freeze)),
            str(int(two_passes)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{strategy}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("strategy", "zero", "freeze", "two_passes"),
    [
        ("allreduce", "module", False, True),  # the DCGAN example's loop as written
        ("ps-sync", "module", False, True),  # the server's mean of the first pass is not its own
        ("ps-sync", "opt", False, False),
        ("box-sync", "module", True, False),  # D frozen in the generator's backward
    ],
)
def test_a_gan_on_two_ranks_equals_one_process(tmp_path, strategy, zero, freeze, two_passes):
    torchrun(tmp_path, strategy, zero, freeze, two_passes)
    reference = gan(None, two_passes=two_passes)
    for rank in range(2):
        assert diff(torch.load(tmp_path / f"{strategy}-rank{rank}.pt"), reference) <= 1e-5, rank


def test_two_dogwild_optimizers_on_two_ranks_keep_their_messages_apart(tmp_path):
    """Each dogwild run sends on a group of its own: two of them (and the loop) never meet."""
    torchrun(tmp_path, "dogwild", "module")
    ranks = [torch.load(tmp_path / f"dogwild-rank{r}.pt") for r in range(2)]
    assert diff(ranks[0], ranks[1]) == 0.0  # close(): every rank holds the master's weights
    assert all(torch.isfinite(v).all() for v in ranks[0].values())


# -- one model, several optimizers ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [s for s in DATA_PARALLEL if s != "eamsgd"])
def test_muon_and_adamw_over_one_model_as_a_list(strategy):
    """Every rule (but eamsgd, whose own step is SGD's) takes the list and steps both; where the rule is
    plain SGD alone, the model equals plain PyTorch with the two optimizers."""
    got = muon_adamw(strategy)
    assert all(torch.isfinite(v).all() for v in got.values())
    if strategy in PLAIN_ALONE or strategy in ("downpour", "dynsgd", "hogwild", "dogwild"):
        assert diff(got, muon_adamw(None)) <= 1e-6


def _chained(strategy: str, steps: range, state: dict | None = None) -> tuple[dict, dict, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if state is not None:
        model.load_state_dict(state["model"])
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01)]
    opt = parambox.DistributedOptimizer(model, opts, strategy)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    for step in steps:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :4])).backward()
        opt.step()
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}
    opt.close()
    return saved, {k: v.clone() for k, v in model.state_dict().items()}, model


@pytest.mark.parametrize("strategy", ["allreduce", "diloco"])
def test_the_listed_optimizers_state_resumes_where_it_stopped(strategy):
    """opt.state_dict() holds both optimizers' state (AdamW's moments, Muon's momentum): 3 steps, a
    fresh process's objects loading it, 3 more, equal the 6 uninterrupted."""
    _, whole, _ = _chained(strategy, range(6))
    saved, _, _ = _chained(strategy, range(3))
    # one optimizer's layout: Muon's matrices numbered first (0, 1), AdamW's biases after them (2, 3)
    assert [g["params"] for g in saved["optimizer"]["param_groups"]] == [[0, 1], [2, 3]]
    assert "momentum_buffer" in saved["optimizer"]["state"][0] and "exp_avg" in saved["optimizer"]["state"][3]
    _, resumed, _ = _chained(strategy, range(3, 6), saved)
    assert diff(resumed, whole) <= 1e-6


def test_a_second_wrapper_on_one_model_and_a_bad_list_are_one_line_errors():
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        parambox.DistributedOptimizer(model, sgd, "easgd"),
        pytest.raises(UserError, match=r"wrapped already, by DistributedOptimizer\('easgd'\).*as a list"),
    ):
        parambox.DistributedOptimizer(model, torch.optim.Adam(model.parameters()), "easgd")
    with pytest.raises(UserError, match="optimizers 0 and 1 of the list both hold a parameter"):
        parambox.DistributedOptimizer(model, [sgd, torch.optim.Adam([model.weight])])
    with pytest.raises(UserError, match="optimizer 1 of the list must be a torch.optim.Optimizer, got str"):
        parambox.DistributedOptimizer(model, [sgd, "adam"])
    with pytest.raises(UserError, match="eamsgd: its momentum step is SGD's"):
        parambox.DistributedOptimizer(
            model, [torch.optim.SGD([model.weight]), torch.optim.SGD([model.bias])], "eamsgd"
        )


@pytest.mark.parametrize("strategy", ["allreduce", "box-sync"])
def test_muon_and_adamw_on_two_ranks_equal_one_process(tmp_path, strategy):
    torchrun(tmp_path, strategy, "muon")
    reference = muon_adamw(None, world=2)
    for rank in range(2):
        assert diff(torch.load(tmp_path / f"{strategy}-rank{rank}.pt"), reference) <= 1e-5, rank


def test_a_zero_redundancy_optimizer_under_allreduce_on_two_ranks_equals_one_process(tmp_path):
    """torch's ZeroRedundancyOptimizer (each rank steps its shard and broadcasts it) over the gradients
    allreduce averaged: plain AdamW on the global batch."""
    torchrun(tmp_path, "allreduce", "zero")
    reference = zero_adamw(None, world=2)
    for rank in range(2):
        assert diff(torch.load(tmp_path / f"allreduce-rank{rank}.pt"), reference) <= 1e-5, rank


def test_a_zero_redundancy_optimizer_is_refused_by_every_other_rule(tmp_path):
    """Under easgd it ran, and each rank's shard took that rank's own step and overwrote the others'
    replicas: the elastic rule silently became another. One process, a group of one."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(4, 2)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        for strategy in ("easgd", "ps-sync", "diloco"):
            with pytest.raises(
                UserError, match=rf"\('{strategy}'\): a ZeroRedundancyOptimizer .* \(allreduce\)"
            ):
                parambox.DistributedOptimizer(model, zero, strategy)
        parambox.DistributedOptimizer(model, zero, "allreduce").close()
    finally:
        dist.destroy_process_group()
