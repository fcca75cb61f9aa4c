"""README.md and the documentation's guide stay true: every code block in them is checked here. Python
blocks run as written (they are whole scripts, kept small; a block that appears twice runs once); every
``parambox ...`` line of a shell block is parsed by the real command line, and a ``train`` line's config
is built as the command would build it (presets, --set keys, strategy options), without training; the
other shell lines name files that exist, or a launcher or installer. A block preceded by
``<!-- no-run: REASON -->`` is skipped (none are today; keep them few and say why)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parambox import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The pages whose code blocks a reader copies: the README, the guide, the home page and the design pages.
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md"] + sorted(
    [*(ROOT / "docs" / "guide").rglob("*.md"), *(ROOT / "docs" / "design").glob("*.md")]
)
BLOCK = re.compile(r"(<!-- no-run: [^>]+ -->\n)?```(\w*)\n(.*?)```", re.S)


def _blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of each block of a page that is not marked no-run."""
    return [(lang, body) for skip, lang, body in BLOCK.findall(path.read_text()) if not skip]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [(_name(p), lang, body) for p in PAGES for lang, body in _blocks(p)]
PYTHON = list(dict.fromkeys(body for _, lang, body in BLOCKS if lang == "python"))  # each distinct one
PYTHON_IDS = [next(page for page, lang, b in BLOCKS if b == body and lang == "python") for body in PYTHON]
SHELL = [(page, body) for page, lang, body in BLOCKS if lang in ("bash", "sh", "console")]


def _commands(body: str) -> list[list[str]]:
    """The block's lines as argv lists, comments dropped and ``\\`` continuations joined."""
    text = body.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out += [_command(shlex.split(part)) for part in line.split("&&")]
    return out


def _command(argv: list[str]) -> list[str]:
    """``argv`` without its leading environment assignments (``VAR=value cmd ...``)."""
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    return argv


LINES = [(page, argv) for page, body in SHELL for argv in _commands(body) if argv]
PARAMBOX_LINES = [argv for _, argv in LINES if argv[0] == "parambox"]
OTHER_LINES = [argv for _, argv in LINES if argv[0] != "parambox"]


def test_the_readme_and_the_guide_have_code_to_check():
    readme_python = [body for lang, body in _blocks(ROOT / "README.md") if lang == "python"]
    readme_lines = [a for p, a in LINES if p == "README.md" and a[0] == "parambox"]
    assert len(readme_python) >= 2 and len(readme_lines) >= 10
    assert len(PARAMBOX_LINES) >= 60 and len(PYTHON) >= 3


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
    if argv[0] not in ("bash", "pip", "python", "torchrun", "srun", "mpiexec", "sbatch", "mkdocs"):
        pytest.fail(f"the documentation runs {argv[0]!r}: add it to this check")
    # an install, a launcher or the site's builder: the launcher tests run these forms; the repository's
    # scripts they name exist
    for arg in argv[1:]:
        if "/" in arg and arg.endswith((".py", ".sh")):
            assert (ROOT / arg).exists(), f"{' '.join(argv)}: {arg} does not exist"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(PYTHON)), ids=PYTHON_IDS)
def test_every_python_block_runs(index, tmp_path):
    script = tmp_path / "doc_block.py"
    script.write_text(PYTHON[index])
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

    from parambox.runtime import zygote

    env = {**os.environ, **env, **zygote.shared_env()}  # its workers fork from this session's zygote
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, (
        f"python block of {PYTHON_IDS[index]}:\n{PYTHON[index]}\n{proc.stderr[-3000:]}"
    )
