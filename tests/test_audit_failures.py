"""The second audit's silent losses (issue 53): a user's ``sys.exit()``, a diverged run, two runs on
one run directory. Each ends non-zero with one line; before, each ended with exit 0."""

from __future__ import annotations

import pytest

from parambox.cli import main

TRAIN = ["train", "--strategy", "single", "--steps", "2", "--eval-every", "0", "--no-progress"]
DATA = "tests.workloads.user_regression:make_data"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("parambox: error: "), err
    return lines[0]


EXITS = {
    "on_import": "import sys\nsys.exit(0)\n\ndef make_model():\n    pass\n",
    "in_factory": "import sys\n\ndef make_model():\n    sys.exit()\n",
    "in_factory_code_3": "import sys\n\ndef make_model():\n    sys.exit(3)\n",
}


@pytest.mark.parametrize("where", sorted(EXITS))
def test_a_users_sys_exit_is_a_failure(where, tmp_path, capsys):
    """Before: exit 0, silent, untrained (``SystemExit`` went past ``except Exception``)."""
    module = tmp_path / f"exits_{where}.py"
    module.write_text(EXITS[where])
    argv = [*TRAIN, "--model", f"{module}:make_model", "--data", DATA, "--out", str(tmp_path / "run")]
    assert main([*argv, "--loader-workers", "0"]) == 2
    line = one_line(capsys)
    assert "sys.exit" in line and ("make_model" in line if where != "on_import" else str(module) in line), (
        line
    )
