"""``parambox info``: what parambox sees here: launcher and world, devices, and what it can run."""

from __future__ import annotations

import argparse
import json
import os
import shutil


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def collect() -> dict:
    import torch

    from parambox.data.registry import DATASETS, _import_loaders
    from parambox.models.registry import MODELS, import_builders
    from parambox.presets import PRESETS
    from parambox.runtime.spawn import find_mpiexec
    from parambox.runtime.world import World
    from parambox.strategies import STRATEGIES

    import_builders()
    _import_loaders()
    world = World.from_env()
    return {
        "world": {**world.__dict__, "device": str(world.device), "backend": world.backend},
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count(),
        "cpu_cores": os.cpu_count(),
        "mpiexec": find_mpiexec(),
        "srun": shutil.which("srun"),
        "strategies": sorted(STRATEGIES),
        "models": sorted(MODELS),
        "data": sorted(DATASETS),
        "presets": {name: first_sentence(fn.__doc__ or "") for name, fn in sorted(PRESETS.items())},
    }


def first_sentence(doc: str) -> str:
    r"""A docstring's first sentence, over as many lines as it takes.

    >>> first_sentence("DiLoCo on the default run: AdamW inner steps,\n    every 10 steps an outer step. More.")
    'DiLoCo on the default run: AdamW inner steps, every 10 steps an outer step.'
    """
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parambox info", show_header=False)
    for key, value in info.items():
        if isinstance(value, dict) and key == "presets":
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(value)
        table.add_row(key, str(value))
    Console().print(table)
    return 0
