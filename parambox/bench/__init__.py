"""Benchmarks that measure setups side by side and report paired ratios: ``parambox bench NAME``.

Each benchmark is a module with one function returning a JSON-able dict; they share one worker
spawner (``workers``, built on ``parambox.runtime.spawn``) and one timed-rounds harness (``rounds``).
Run one at a time: they share the machine's cores.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from parambox.errors import UserError

BENCHES: dict[str, tuple[str, str, str]] = {  # name -> (module, function, what it measures)
    "sync": ("parambox.bench.sync", "run_bench_sync", "allreduce / box-sync vs torch DDP"),
    "box": ("parambox.bench.box", "run_bench_box", "box pull/push bandwidth vs gloo and MPI"),
    "async": ("parambox.bench.asynchronous", "run_bench_async", "asynchronous strategies vs plain Hogwild"),
    "local": ("parambox.bench.local", "run_bench_local", "local parallelism study (Lerat et al.)"),
    "optimizer": (
        "parambox.bench.optimizer",
        "run_bench_optimizer",
        "DistributedOptimizer(allreduce) in a user's loop vs torch DDP",
    ),
    "api": (
        "parambox.bench.api",
        "run_bench_api",
        "parambox.train vs a plain loop; a slow dataset's hidden load",
    ),
    "cluster": ("parambox.bench.cluster", "run_bench_cluster", "every strategy vs DDP on rate-limited links"),
    "defaults": (
        "parambox.bench.defaults",
        "run_bench_defaults",
        "every strategy's default digits run over seeds: does it train?",
    ),
    "chaos": (
        "parambox.bench.chaos",
        "run_bench_chaos",
        "easgd, asynchronous diloco and allreduce under a fault every ~30 s vs none",
    ),
    "sandblaster": (
        "parambox.bench.sandblaster",
        "run_bench_sandblaster",
        "Sandblaster with one worker 5x slower: the whole step vs its portion phase, backups vs none",
    ),
}


def benchmark(name: str) -> Callable[..., dict[str, Any]]:
    """The function that runs benchmark ``name``."""
    if name not in BENCHES:
        raise UserError(f"unknown benchmark {name!r}; choose from {', '.join(sorted(BENCHES))}")
    module, fn, _ = BENCHES[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError):
        raise UserError(f"benchmark {name!r} is not available in this build") from None
