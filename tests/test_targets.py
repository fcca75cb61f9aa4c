"""A study's target (``parambox.workload.targets``): which way each metric improves, the ``--target`` forms,
and reaching, first and best in that direction."""

from __future__ import annotations

import pytest

from parambox.errors import UserError
from parambox.workload.targets import Target, lower_is_better


@pytest.mark.parametrize(
    "metric, lower",
    [
        ("perplexity", True),
        ("test_bits_per_byte", True),
        ("loss", True),
        ("val_loss", True),
        ("accuracy", False),
        ("test_acc", False),
        ("f1", False),
    ],
)
def test_which_way_each_metric_improves(metric, lower):
    assert lower_is_better(metric) is lower


@pytest.mark.parametrize(
    "text, metric, value, lower",
    [
        ("perplexity=12", "perplexity", 12.0, True),
        ("test_bits_per_byte = 3.5", "bits_per_byte", 3.5, True),
        ("accuracy=0.9", "accuracy", 0.9, False),
        ("wer<=0.2", "wer", 0.2, True),  # a user's metric that falls: the direction said outright
        ("loss>=1", "loss", 1.0, False),  # said outright, it wins over the table
    ],
)
def test_target_forms(text, metric, value, lower):
    assert Target.parse(text) == Target(metric, value, lower)


@pytest.mark.parametrize(
    "text, message",
    [
        ("perplexity", "expected METRIC=VALUE"),
        ("perplexity=abc", "expected METRIC=VALUE"),
        ("perplexity=inf", "expected METRIC=VALUE"),
        ("9=1", "expected METRIC=VALUE"),
        ("perplexity=0.5", "a perplexity is at least 1"),
        ("accuracy=98", "accuracy is a fraction within (0, 1]"),
        ("bits_per_byte=0", "must be > 0"),
    ],
)
def test_bad_targets_are_one_line(text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        Target.parse(text)
    assert "\n" not in str(e.value)


def test_reaching_first_and_best_follow_the_direction():
    ppl, acc = Target.of("perplexity", 8.0), Target.of("accuracy", 0.9)
    assert [ppl.reached(v) for v in (7.9, 8.0, 8.1, None, float("nan"))] == [True, True, False, False, False]
    assert [acc.reached(v) for v in (0.89, 0.9, 0.95, None)] == [False, True, True, False]
    points = [(1, 12.0), (2, 9.0), (3, 7.5), (4, 6.0)]
    assert ppl.first(points) == 3 and Target.of("perplexity", 5.0).first(points) is None
    assert ppl.best([12.0, None, 7.5, 9.0]) == 7.5 and acc.best([0.5, 0.8, None]) == 0.8
    assert acc.best([None]) is None
    assert ppl.key == "test_perplexity" and str(ppl) == "perplexity <= 8" and str(acc) == "accuracy >= 0.9"
