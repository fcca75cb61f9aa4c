"""Audit item 5: the overlapped outer step is named for what it does (the delayed global weights plus the
worker's own progress), and not attributed to Streaming DiLoCo or to eager updates (Kale et al. 2025)."""

from __future__ import annotations

import re

from parambox.strategies import diloco, exchange


def test_the_overlap_option_says_what_the_rule_is():
    text = exchange.ExchangeOptions.model_fields["overlap"].description
    assert "delayed global weights" in text and "own progress" in text


def test_no_docstring_says_the_overlapped_step_follows_streaming_diloco_or_eager_updates():
    for module in (exchange, diloco):
        doc = " ".join(module.__doc__.split())
        assert "delayed global weights plus" in doc, module.__name__
        for claim in (r"as in Streaming DiLoCo", r"one-step delayed DiLoCo of Kale", r"without mixing"):
            assert not re.search(claim, doc), (module.__name__, claim)
