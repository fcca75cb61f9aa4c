"""Loss compare (torchtitan's habit): fixed-seed runs must keep their per-step loss curves.

``tests/data/loss_compare.json`` holds rank 0's ``loss`` per step (from ``metrics.jsonl``) of a few
short runs, generated from the code as it was when the fixture was written. Any refactor that changes
the numerics shows up here. Regenerate, only on purpose, with::

    python tests/test_loss_compare.py --regenerate
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: make ``tests.conftest`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import run_cli

FIXTURE = Path(__file__).parent / "data" / "loss_compare.json"
RTOL = 1e-6
COMMON = ["--data", "digits", "--steps", "20", "--seed", "0", "--eval-every", "0", "--no-progress"]
COMMON += ["--threads", "1"]  # one thread: the same reduction order on any machine
RUNS: dict[str, list[str]] = {
    "allreduce-mlp-2": ["--strategy", "allreduce", "--workers", "2", "--model", "mlp", "--momentum", "0"],
    "pipeline-lenet-2": [
        "--strategy", "pipeline", "--workers", "2", "--model", "lenet",
        "--set", "pipeline.num_microbatches=4", "--set", "pipeline.schedule=gpipe",
        "--batch-size", "32",
    ],
    "single-lenet-1": ["--strategy", "single", "--workers", "1", "--model", "lenet", "--batch-size", "32"],
}  # fmt: skip


def step_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"]


def run_losses(name: str, out: Path) -> list[float]:
    run_cli("train", *RUNS[name], *COMMON, "--out", str(out))
    return step_losses(out)


@pytest.mark.timeout(170)
@pytest.mark.parametrize(  # the lenet runs (a pipeline, one process): the full suite
    "name", [n if n == "allreduce-mlp-2" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(RUNS)]
)
def test_loss_curve_is_unchanged(name, tmp_path):
    expected = json.loads(FIXTURE.read_text())[name]
    got = run_losses(name, tmp_path / "run")
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) <= RTOL * max(abs(b), 1e-12), f"{name}: step {step}: loss {a!r}, fixture {b!r}"


def regenerate() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: run_losses(name, Path(tmp) / name) for name in sorted(RUNS)}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(losses, indent=1) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_loss_compare.py --regenerate")
    regenerate()
