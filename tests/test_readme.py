"""README.md stays true: every code block in it is checked here. Python blocks run as written (they
are whole scripts, kept small); every ``parambox ...`` line of a shell block is parsed by the real
command line, and a ``train`` line's config is built as the command would build it (presets, --set
keys, strategy options), without training; the other shell lines name files that exist."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parambox import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
PYTHON = [body for lang, body in BLOCKS if lang == "python"]
SHELL = [body for lang, body in BLOCKS if lang in ("bash", "sh", "console")]


def _commands(body: str) -> list[list[str]]:
    """The block's lines as argv lists, comments dropped and ``\\`` continuations joined."""
    text = body.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out += [shlex.split(part) for part in line.split("&&")]
    return out


PARAMBOX_LINES = [argv for body in SHELL for argv in _commands(body) if argv and argv[0] == "parambox"]
OTHER_LINES = [argv for body in SHELL for argv in _commands(body) if argv and argv[0] != "parambox"]


def test_the_readme_has_code_to_check():
    assert len(PYTHON) >= 2 and len(PARAMBOX_LINES) >= 20


@pytest.mark.parametrize("argv", PARAMBOX_LINES, ids=[" ".join(a[1:4]) for a in PARAMBOX_LINES])
def test_every_parambox_line_parses_and_its_config_builds(argv, tmp_path, monkeypatch):
    args = cli.parse(argv[1:])
    if args.command != "train":
        return
    from parambox.commands.train import config_from_args

    names_a_users_file = any(".py:" in a or a.endswith(".toml") for a in argv)
    if names_a_users_file:  # mine.py / run.toml are the reader's own files
        return
    monkeypatch.chdir(tmp_path)
    cfg = config_from_args(args)
    cfg.strategy_options()  # the strategy's own options validate


@pytest.mark.parametrize("argv", OTHER_LINES, ids=[" ".join(a[:3]) for a in OTHER_LINES])
def test_other_shell_lines_name_what_exists(argv):
    if argv[0] == "bash":
        assert (ROOT / argv[1]).exists()
    elif argv[0] in ("pip", "python", "torchrun", "srun", "mpiexec", "sbatch"):
        pass  # an install or a launcher: the launcher tests run these forms
    else:
        pytest.fail(f"README runs {argv[0]!r}: add it to this check")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_python_block_runs(index, tmp_path):
    script = tmp_path / "readme_block.py"
    script.write_text(PYTHON[index])
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    from parambox.runtime import zygote

    env = {**os.environ, **env, **zygote.shared_env()}  # its workers fork from this session's zygote
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, f"README python block {index}:\n{PYTHON[index]}\n{proc.stderr[-3000:]}"
