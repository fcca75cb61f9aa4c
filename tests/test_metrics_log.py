"""metrics.jsonl reaches the disk often enough to follow a slow run (and for the launcher's heartbeat)."""

import json

from parambox.training import metrics
from parambox.training.metrics import FLUSH_EVERY, FLUSH_S, MetricsLogger


def _on_disk(path):
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_step_records_are_flushed_every_n_steps_or_every_few_seconds(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    log = MetricsLogger(tmp_path, rank=0)
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 4):  # fast steps: buffered
        log.write({"kind": "step", "step": step, "loss": 1.0})
    assert _on_disk(path) == []
    clock[0] += FLUSH_S  # a slow step: on disk with the ones before it
    log.write({"kind": "step", "step": 4, "loss": 1.0})
    assert [r["step"] for r in _on_disk(path)] == [1, 2, 3, 4]
    for step in range(5, 5 + FLUSH_EVERY - 1):
        log.write({"kind": "step", "step": step, "loss": 1.0})
    assert len(_on_disk(path)) == 4
    log.write({"kind": "step", "step": 4 + FLUSH_EVERY, "loss": 1.0})  # the n-th since the last flush
    assert len(_on_disk(path)) == 4 + FLUSH_EVERY
    log.write({"kind": "step", "step": 5 + FLUSH_EVERY, "loss": 1.0})
    log.write({"kind": "eval", "step": 5 + FLUSH_EVERY, "test_loss": 0.5})  # an eval: at once
    assert _on_disk(path)[-1]["kind"] == "eval" and len(_on_disk(path)) == 6 + FLUSH_EVERY
    log.close()
