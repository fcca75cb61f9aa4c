"""Tier (c): `parambox bench defaults --quick --json` trains each of its strategies' default run and says
whether it reached the target (issue 21: every strategy's defaults train)."""

from __future__ import annotations

import json

import pytest

from parambox.bench.defaults import QUICK, TARGET
from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_defaults_quick():
    result = json.loads(run_cli("bench", "defaults", "--quick", "--json", timeout=880).stdout)
    assert result["seeds"] == QUICK["seeds"] and list(result["strategies"]) == QUICK["strategies"]
    for name, r in result["strategies"].items():
        assert r["errors"] == {}, (name, r)
        assert r["min"] >= TARGET and r["below_target"] == [], (name, r)  # diloco: 0.10 before


def test_strategies_bring_their_own_optimizer_unless_the_user_chose():
    from parambox.config import build_config

    cfg = build_config({"strategy": "diloco"})
    assert (cfg.optimizer, cfg.lr, cfg.strategy_options().inner_steps) == ("adamw", 1e-3, 10)
    cfg = build_config({"strategy": "diloco", "options": {"diloco": {"asynchronous": True}}})
    assert cfg.strategy_options().outer_momentum == 0.5
    cfg = build_config({"strategy": "diloco", "lr": 0.01, "options": {"diloco": {"inner_steps": 5}}})
    assert (cfg.optimizer, cfg.lr, cfg.strategy_options().inner_steps) == ("sgd", 0.01, 5)
    rates = {
        name: build_config({"strategy": name}).lr for name in ("hogwild", "downpour", "dogwild", "dynsgd")
    }
    assert rates == {"hogwild": 0.015, "downpour": 0.015, "dogwild": 0.01, "dynsgd": 0.03}  # (dynsgd damps)
    assert build_config({"strategy": "hogwild", "optimizer": "adam"}).lr == 0.03  # not a rate meant for SGD
    cfg = build_config({"strategy": "sandblaster", "steps": 40})
    assert (cfg.batch_size, cfg.weight_decay, cfg.steps) == (1438, 1e-3, 40)
    assert build_config({"strategy": "single"}).batch_size == 64  # the default run's global batch
    assert build_config({"strategy": "single", "batch_size": 8}).batch_size == 8
    assert build_config({"strategy": "allreduce"}).lr == 0.03
