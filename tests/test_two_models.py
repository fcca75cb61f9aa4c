"""Two models in one loop (a GAN), each in its own DistributedOptimizer: the generator's backward goes
through the discriminator, whose gradients the loop then zeroes mid-step, with ``optD.zero_grad()`` or
the module's ``D.zero_grad()`` (``.grad = None``, as PyTorch's DCGAN example writes it). Before, a
rule with ``.grad`` views added the dropped gradient back (allreduce, and every rule reading its flat
buffer: a silently different model), ps-sync and box-sync refused the loop with an error about
micro-steps, and two dogwild optimizers crossed their messages on the default group."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from parambox.errors import UserError
from parambox.strategies import STRATEGIES, strategy_class
from tests.gan_worker import gan

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


def test_allreduce_takes_the_dcgan_examples_two_backward_passes_after_a_module_zero_grad():
    """PyTorch's DCGAN loop: ``D.zero_grad()``, the real and the fake loss in two backward passes."""
    assert diff(gan("allreduce", "module", two_passes=True), gan(None, two_passes=True)) <= 1e-6


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
            str(ROOT / "tests" / "gan_worker.py"),
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
        ("ps-sync", "module", False, False),
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
