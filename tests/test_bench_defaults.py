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


def test_compression_rows_are_each_encoding_a_strategy_accepts():
    """``bench defaults --compression``: a row per strategy and encoding its options accept, run with
    ``--set STRATEGY.compression=MODE``; powersgd only where the exchange can take it."""
    from parambox.bench.defaults import _rows

    rows = _rows(["allreduce", "weight-avg", "hogwild"], ["none", "int8", "powersgd"])
    assert [r[0] for r in rows] == [
        "allreduce",
        "allreduce compression=int8",
        "allreduce compression=powersgd",
        "weight-avg",
        "weight-avg compression=int8",
        "hogwild",  # (no compression to vary: as it is)
    ]
    assert rows[1][2] == ["--set", "allreduce.compression=int8"]
    proc = run_cli("bench", "defaults", "--compression", "int9", check=False)
    assert proc.returncode == 2 and "--compression 'int9'" in proc.stderr


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


def test_a_perplexity_run_of_bench_defaults_renders_on_a_results_page(tmp_path):
    """scripts/defaults_results.py turns `bench defaults --json` into a results page's JSON that
    scripts/gen_docs.py renders: the figure named, its direction said, failures and short seeds listed."""
    import importlib.util

    from tests.conftest import ROOT

    def load(name):
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    bench = {  # the shape run_bench_defaults returns for --model gpt --steps 50 --seeds 0,1
        "target": 26.3, "model": "gpt", "data": "text", "metric": "perplexity", "lower_is_better": True,
        "seeds": [0, 1], "steps": 50,
        "strategies": {
            "allreduce": {"min": 20.5, "max": 21.25, "perplexity": {"0": 20.5, "1": 21.25}, "below_target": [],
                          "errors": {}, "seconds": 61.0},
            "easgd": {"min": 24.0, "max": 30.1, "perplexity": {"0": 24.0, "1": 30.1}, "below_target": [1],
                      "errors": {}, "seconds": 70.2},
            "hogwild": {"min": None, "max": None, "perplexity": {"0": None, "1": None}, "below_target": [0, 1],
                        "errors": {"0": "exit 1", "1": "exit 1"}, "seconds": 3.0},
        },
    }  # fmt: skip
    data = load("defaults_results").results(
        bench, "parambox bench defaults --model gpt --steps 50 --seeds 0,1"
    )
    page = load("gen_docs").results_page("defaults-gpt", data)
    assert "# Every strategy's default run: gpt on text" in page
    assert "## Test perplexity over the seeds (target: at most 26.3)" in page and "lower is better" in page
    assert "| allreduce | 20.5 | 21.2 | - | 61 |" in page
    assert (
        "| easgd | 24.0 | 30.1 | 1 | 70 |" in page
        and "| hogwild | failed | failed | 0, 1 (exit 1) | 3 |" in page
    )
    assert "Command: `parambox bench defaults --model gpt --steps 50 --seeds 0,1`" in page
