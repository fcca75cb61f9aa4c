"""Tier (a): a batch is any structure of tensors and the loss is the user's ``loss(model, batch)``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parambox.runtime.world import World
from parambox.strategies import Context, build_strategy
from parambox.strategies.sandblaster.portions import compute_portion
from parambox.strategies.tensors import batch_size, map_tensors
from parambox.training.faults import FaultPlan


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["target"]) ** 2).mean()


def test_batch_size_is_the_first_tensors_length():
    assert batch_size(torch.zeros(5, 2)) == 5
    assert batch_size({"meta": "a", "x": torch.zeros(3), "y": torch.zeros(9)}) == 3
    assert batch_size(([1, 2], (torch.zeros(4),))) == 4
    with pytest.raises(ValueError, match="at least one tensor"):
        batch_size(("no", "tensors"))


def test_map_tensors_keeps_the_structure():
    out = map_tensors(lambda t: t + 1, {"a": (torch.zeros(1), [torch.ones(1)]), "n": 3})
    assert out["n"] == 3 and isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert float(out["a"][0]) == 1.0 and float(out["a"][1][0]) == 2.0


def test_nan_fault_turns_every_floating_tensor_into_nan():
    batch = {"x": torch.ones(2, 3), "w": torch.ones(2), "label": torch.tensor([1, 2])}
    out = FaultPlan.parse("0:5:nan").inject(0, 5, batch)
    assert out["x"].isnan().all() and out["w"].isnan().all()
    assert torch.equal(out["label"], batch["label"])
    assert FaultPlan.parse("1:5:nan").inject(0, 9, batch) is batch  # another rank's fault
    assert not FaultPlan.from_env({})


def test_a_partition_fault_needs_a_duration_and_an_emulated_node():
    assert FaultPlan.parse("2:10:partition=2.5").faults == ((2, 10, "partition=2.5"),)
    for bad in ("partition", "partition=0", "partition=x"):
        with pytest.raises(ValueError, match="expected partition=SECONDS"):
            FaultPlan.parse(f"1:3:{bad}")
    with pytest.raises(RuntimeError, match="not on an emulated node"):  # this process: the host's links
        FaultPlan.parse("0:1:partition=1").inject(0, 1, None)


def test_single_steps_a_dict_batch_with_a_user_loss():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ctx = Context(World(), model, lambda p: torch.optim.SGD(p, lr=0.1), mse, 1, 5.0)
    strategy = build_strategy("single", ctx)
    batch = {"x": torch.randn(8, 3), "target": torch.randn(8, 1)}
    with torch.no_grad():
        before = float(mse(model, batch))
    result = strategy.step(batch, 0)
    assert result.samples == 8 and result.loss == pytest.approx(before)
    with torch.no_grad():
        assert float(mse(model, batch)) < before


def test_sandblaster_portions_slice_any_batch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    batch = {"x": torch.randn(6, 3), "target": torch.randn(6, 1)}
    halves = [compute_portion(model, mse, batch, b) for b in ((0, 2), (2, 6))]
    whole = compute_portion(model, mse, batch, (0, 6))
    assert float(halves[0][1] + halves[1][1]) == 6.0  # samples
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0])  # loss sums
    torch.testing.assert_close(halves[0][3:] + halves[1][3:], whole[3:])  # gradient sums
