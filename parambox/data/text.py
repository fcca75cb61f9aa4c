"""``text``: a byte-level corpus every machine has, the Python standard library's own sources.

Without ``data_path`` the stream is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(site-packages left out), in sorted path order, capped at ``CORPUS_BYTES``: on CPython 3.11, 4 MiB
from 357 files. With ``data_path`` it is that file, or every regular non-hidden file under that
folder in sorted path order, capped the same way. No network either way.

A sample is a window of ``CONTEXT + 1`` bytes: the first ``CONTEXT`` are the input, the last
``CONTEXT`` the targets (the next byte at every position). Training windows start every
``CONTEXT`` bytes. The last 5 % of the stream, at most ``TEST_WINDOWS`` windows, is the test set:
the split is fixed (not drawn from the seed), so test figures of different runs compare. Windows are
uint8 views of one stream (1 byte a token in memory); ``gpt`` takes them as they are.

>>> x, y = windows(torch.arange(10, dtype=torch.uint8), 4)
>>> x.tolist(), y.tolist()
([[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4], [5, 6, 7, 8]])
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from parambox.data.base import Dataset
from parambox.data.registry import register
from parambox.errors import UserError

CONTEXT = 128
CORPUS_BYTES = 4 * 2**20
TEST_FRACTION = 0.05
TEST_WINDOWS = 256  # 32 KiB: one evaluation of the 1M-parameter gpt costs ~2 s of one CPU core
VOCAB = 256
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted relative-path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]  # pruned, not walked: site-packages is big
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def user_files(data_path: Path) -> list[Path]:
    """``data_path`` itself, or the regular non-hidden files under it in sorted order."""
    if data_path.is_file():
        return [data_path]
    if not data_path.is_dir():
        raise UserError(f"data set 'text': data path {data_path} is neither a file nor a folder")
    files = [
        p
        for p in data_path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(data_path).parts)
    ]
    if not files:
        raise UserError(f"data set 'text': folder {data_path} holds no files")
    return sorted(files, key=lambda p: p.relative_to(data_path).as_posix())


def read_stream(files: list[Path], limit: int = CORPUS_BYTES) -> torch.Tensor:
    """The files' bytes one after the other, the first ``limit`` of them, as a uint8 tensor."""
    parts, size = [], 0
    for path in files:
        try:
            data = path.read_bytes()[: limit - size]
        except OSError as e:
            raise UserError(f"data set 'text': cannot read {path}: {e.strerror}") from None
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def windows(stream: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each ``(N, context)``: views of ``stream`` at every ``context``-th byte."""
    n = (len(stream) - 1) // context
    return stream[: n * context].view(n, context), stream[1 : n * context + 1].view(n, context)


def split(stream: torch.Tensor, context: int = CONTEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) parts of the stream, disjoint: the test part is its last 5 %, at most
    ``TEST_WINDOWS`` windows, and never less than one window."""
    test_len = min(int(len(stream) * TEST_FRACTION), TEST_WINDOWS * context + 1)
    test_len = max(test_len, context + 1)
    if len(stream) - test_len < context + 1:
        raise UserError(
            f"data set 'text' needs at least {2 * (context + 1)} bytes (a training and a test window of "
            f"{context + 1}), got {len(stream)}"
        )
    return stream[: len(stream) - test_len], stream[len(stream) - test_len :]


@register("text")
def load_text(data_path: Path | None, seed: int) -> Dataset:
    """Windows of 128 bytes: from the standard library's sources, or from ``data_path``'s files."""
    del seed  # the split is fixed on purpose
    files = stdlib_files() if data_path is None else user_files(data_path)
    train, test = split(read_stream(files))
    train_x, train_y = windows(train, CONTEXT)
    test_x, test_y = windows(test, CONTEXT)
    return Dataset("text", train_x, train_y, test_x, test_y, num_classes=VOCAB, sequence=True)
