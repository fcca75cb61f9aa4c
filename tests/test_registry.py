"""Tier (a): the registry is the list of strategies, and each one comes with what a strategy needs:
a preset, a row in README's strategy table and a multi-process test. A new strategy touches its
module, one registry line, one preset and one test (and this table, which names the test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parambox.errors import UserError
from parambox.presets import PRESETS
from parambox.strategies import STRATEGIES, strategy_class

ROOT = Path(__file__).resolve().parents[1]
# strategy -> a test that runs it in several processes (``single``: the test that refuses a second)
MULTI_PROCESS_TESTS = {
    "single": "test_strategy_worker_limits_are_checked",
    "allreduce": "test_sync_numerics.py::test_two_workers_match_single_at_double_batch",
    "ps-sync": "test_sync_numerics.py::test_two_workers_match_single_at_double_batch",
    "weight-avg": "test_sync_numerics.py::test_two_workers_match_single_at_double_batch",
    "box-sync": "test_sync_numerics.py::test_box_sync_matches_single_at_double_batch",
    "downpour": "test_async_train.py::test_default_digits_run_reaches_093",
    "easgd": "test_async_train.py::test_default_digits_run_reaches_093",
    "eamsgd": "test_async_train.py::test_default_digits_run_reaches_093",
    "dynsgd": "test_async_train.py::test_default_digits_run_reaches_093",
    "hogwild": "test_hogwild_dogwild.py::test_hogwild_rule_each_worker_steps_the_shared_weights_with_its_own_momentum",
    "dogwild": "test_hogwild_dogwild.py::test_dogwild_rule_plain_sgd_applies_every_gradient",
    "diloco": "test_diloco.py::test_sync_diloco_with_lr_1_and_no_momentum_is_weight_avg",
    "hybrid": "test_hybrid.py::test_hybrid_rule_allreduce_in_group_then_elastic_exchange_of_the_leaders",
    "pipeline": "test_pipeline.py::test_pipeline_gpipe_two_stages_four_microbatches_matches_single",
    "pipeline-dp": "test_pipeline.py::test_pipeline_dp_two_stages_two_groups_matches_single_at_double_batch",
    "sandblaster": "test_sandblaster.py::test_a_worker_slowed_5x_does_not_hold_the_batch_up",
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_has_a_preset(name):
    assert any(fn().get("strategy") == name for fn in PRESETS.values()), f"no preset runs {name!r}"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_has_a_readme_row(name):
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"^\| `{re.escape(name)}` \|", readme, re.M), f"README's strategy table lacks {name!r}"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_has_a_multi_process_test(name):
    assert name in MULTI_PROCESS_TESTS, f"name a multi-process test of {name!r} in MULTI_PROCESS_TESTS"
    file, _, test = MULTI_PROCESS_TESTS[name].rpartition("::")
    source = (ROOT / "tests" / (file or "test_registry.py")).read_text()
    assert re.search(rf"^def {test}\(", source, re.M), f"{MULTI_PROCESS_TESTS[name]} does not exist"
    assert name in source, f"{file} never names {name!r}"


def test_strategy_worker_limits_are_checked():
    single, pipeline = strategy_class("single"), strategy_class("pipeline")
    assert single.accepts_workers(1) and not single.accepts_workers(2)
    assert pipeline.accepts_workers(2) and not pipeline.accepts_workers(1)
    with pytest.raises(UserError, match="'single' runs one process, not 2"):
        single.check_workers(2)
    with pytest.raises(UserError, match="needs at least 2 workers"):
        pipeline.check_workers(1)


def test_options_choose_the_class_that_runs():
    """The launcher reads ``tolerates_worker_loss`` from the class that will really run."""
    assert strategy_class("easgd", {"sync": False}).tolerates_worker_loss
    sync = strategy_class("easgd", {"sync": True})
    assert not sync.tolerates_worker_loss and sync.name == "easgd"
    assert strategy_class("eamsgd", {"sync": True}).name == "eamsgd"
    assert strategy_class("allreduce", {}) is strategy_class("allreduce")
