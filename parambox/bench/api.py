"""``parambox bench api``: what the library API costs, measured side by side.

1. Overhead: ``parambox.train(strategy="single", workers=1)`` on the ~1M-parameter benchmark CNN
   (batch 64, SGD momentum 0.9, one thread) against a plain PyTorch loop doing the same steps on the
   same in-memory data. Per round each setup runs ``warmup + steps`` steps; a parambox run's step time
   comes from its own ``metrics.jsonl`` (steps after the warm-up), so start-up is not counted. The
   figure is the median of the per-round paired ratios (``bench/rounds.py``); target <= 1.03.
2. A slow dataset: every item sleeps ``sleep_ms`` (decoding, augmentation). ``loader_workers=2``
   background loaders against the same dataset without the sleep: the fraction of the loading time
   (batch x sleep per step) hidden behind compute, ``1 - (t_slow - t_fast) / t_load``; target >= 0.8.
   ``loader_workers=0`` (loading in the training process) shows what is hidden.

Run it alone on a quiet machine: ``parambox bench api --json``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from parambox.bench.rounds import paired_ratio
from parambox.runtime import scratch
from parambox.runtime.heap import keep_freed_memory

BATCH = 64
NUM_ITEMS = 2048


class SleepyDataset(Dataset):
    """A map-style dataset whose every item costs ``sleep_s`` of waiting, as decoding would."""

    def __init__(self, base: Dataset, sleep_s: float):
        self.base, self.sleep_s = base, sleep_s

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.base[i]


def _model():
    from parambox.models import build_model

    return build_model("cnn", (3, 32, 32), 10)


def _tensors(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(NUM_ITEMS, 3, 32, 32, generator=g), torch.randint(0, 10, (NUM_ITEMS,), generator=g)
    )


def plain_step_s(data: TensorDataset, steps: int, warmup: int) -> float:
    """Seconds per step of the plain loop a user would write (batches by the same sampler)."""
    from parambox.data.base import GlobalBatchSampler

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = GlobalBatchSampler(len(data), BATCH, 0, 1, seed=0)
    x_all, y_all = data.tensors
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        idx = sampler.indices(step)
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def train_step_s(dataset: Dataset, steps: int, warmup: int, loader_workers: int, out: Path) -> float:
    """Seconds per step of ``parambox.train`` in this process, from its metrics.jsonl."""
    import parambox

    parambox.train(
        model=_model,
        data=lambda: (dataset, None),
        strategy="single",
        workers=1,
        steps=warmup + steps,
        batch_size=BATCH,
        lr=0.01,
        momentum=0.9,
        threads=1,
        eval_every=0,
        progress=False,
        loader_workers=loader_workers,
        out=str(out),
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in records if r["kind"] == "step"]
    return (times[-1] - times[warmup - 1]) / steps


def run_bench_api(rounds: int = 5, steps: int = 20, warmup: int = 5, sleep_ms: float = 0.5) -> dict[str, Any]:
    torch.set_num_threads(1)
    keep_freed_memory()
    data = _tensors()
    slow = SleepyDataset(data, sleep_ms / 1000)
    times: dict[str, list[float]] = {k: [] for k in ("plain", "train", "fast", "slow", "slow_serial")}
    with scratch.folder(scratch.BENCH) as tmp:
        runs = iter(range(10**6))

        def out() -> Path:
            return Path(tmp) / f"run{next(runs)}"

        for r in range(rounds):
            pair = [("plain", lambda: plain_step_s(data, steps, warmup)),
                    ("train", lambda: train_step_s(data, steps, warmup, 2, out()))]  # fmt: skip
            for name, measure in pair[r % 2 :] + pair[: r % 2]:  # alternate the order
                times[name].append(measure())
            times["fast"].append(train_step_s(SleepyDataset(data, 0.0), steps, warmup, 2, out()))
            times["slow"].append(train_step_s(slow, steps, warmup, 2, out()))
            if r == 0:  # once: loading in the training process, nothing hidden
                times["slow_serial"].append(train_step_s(slow, steps, warmup, 0, out()))
    load_s = BATCH * sleep_ms / 1000
    hidden = [1 - (s - f) / load_s for s, f in zip(times["slow"], times["fast"])]
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": "cnn",
        "batch_size": BATCH,
        "rounds": rounds,
        "steps": steps,
        "step_ms": {k: 1000 * v for k, v in median.items()},
        "train_vs_plain_step_time": paired_ratio(times["train"], times["plain"]),
        "train_vs_plain_target": 1.03,
        "slow_dataset": {
            "sleep_ms_per_item": sleep_ms,
            "load_ms_per_step": 1000 * load_s,
            "loader_workers": 2,
            "hidden_fraction": statistics.median(hidden),
            "hidden_target": 0.8,
            "serial_hidden_fraction": 1 - (median["slow_serial"] - median["fast"]) / load_s,
        },
    }


if __name__ == "__main__":
    print(json.dumps(run_bench_api(), indent=2))
