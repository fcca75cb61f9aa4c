"""The strategy's options are built once per process: the launcher's checks (the strategy's defaults, the plan,
shrink's check) and the worker's set-up (its process group, its strategy) all read the one ``Options`` built
from the run's table (before: 4 in a one-worker run, whose worker is the launcher's own process; 2 in each
spawned worker)."""

from __future__ import annotations

import pytest

from parambox import config
from parambox.cli import main
from parambox.strategies import base


@pytest.mark.parametrize("strategy", ["allreduce", "diloco"])  # diloco brings default options of its own
def test_a_one_worker_run_builds_its_strategy_options_once(tmp_path, monkeypatch, strategy):
    built = []
    init = base.Options.__init__

    def counting(self, /, **data):
        built.append(type(self).__name__)
        init(self, **data)

    monkeypatch.setattr(base.Options, "__init__", counting)
    monkeypatch.setattr(config, "_OPTIONS", {}, raising=False)  # nothing built by an earlier test here
    args = ["train", "--strategy", strategy, "--workers", "1", "--steps", "2", "--eval-every", "0"]
    args += ["--no-progress", "--model", "logreg", "--data", "digits", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    assert len(built) == 1, built


def test_a_different_table_is_its_own_options():
    a = config.strategy_options("weight-avg", {"period": 3})
    assert config.strategy_options("weight-avg", {"period": 3}) is a
    assert config.strategy_options("weight-avg", {"period": 5}).period == 5
