"""``text``: a byte-level corpus every machine has, the Python standard library's own sources.

Without ``data_path`` the stream is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(site-packages left out), in sorted path order, capped at ``CORPUS_BYTES``: on CPython 3.11, 4 MiB
from 321 files. With ``data_path`` it is that file, or every regular non-hidden file under that
folder in sorted path order, capped the same way. No network either way.

A sample is a window of ``CONTEXT + 1`` bytes: the first ``CONTEXT`` are the input, the last
``CONTEXT`` the targets (the next byte at every position). Training windows start every
``CONTEXT`` bytes. The test set is 5 % of the stream, at most ``TEST_WINDOWS`` windows, from the end
of each of 16 equal chunks of it (``split``): the split is fixed (not drawn from the seed), so test
figures of different runs compare. Tokens are int64 byte values 0..255, what ``nn.Embedding`` and
``F.cross_entropy`` take, so a user's own language model reads the windows as they are (8 bytes a token:
32 MiB for the 4 MiB corpus, held once; windows are views of it).

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
TEST_PIECES = 16
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


def split(stream: torch.Tensor, context: int = CONTEXT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(train, test) parts of the stream, disjoint: the stream cut into ``TEST_PIECES`` equal chunks
    (fewer for a short stream), the end of each chunk test, the rest training. The test set is 5 % of
    the stream, at most ``TEST_WINDOWS`` windows and at least one; from every chunk, so it samples
    the whole corpus and not only its last files (the standard library's would be codec tables)."""
    num_windows = max(1, min(TEST_WINDOWS, int(len(stream) * TEST_FRACTION) // context))
    pieces = min(TEST_PIECES, num_windows)
    test_len = (num_windows // pieces) * context + 1
    chunk = len(stream) // pieces
    if chunk - test_len < context + 1:
        raise UserError(
            f"data set 'text' needs at least {2 * (context + 1)} bytes (a training and a test window of "
            f"{context + 1}), got {len(stream)}"
        )
    ends = [chunk * (i + 1) if i < pieces - 1 else len(stream) for i in range(pieces)]
    train = [stream[end - chunk if i else 0 : end - test_len] for i, end in enumerate(ends)]
    return train, [stream[end - test_len : end] for end in ends]


def windows_of(parts: list[torch.Tensor], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of every part, one part after the other; none spans two parts."""
    xs, ys = zip(*(windows(p, context) for p in parts))
    return torch.cat(xs), torch.cat(ys)


@register("text", sequence=True)
def load_text(data_path: Path | None, seed: int) -> Dataset:
    """Windows of 128 bytes: from the standard library's sources, or from ``data_path``'s files."""
    del seed  # the split is fixed on purpose
    files = stdlib_files() if data_path is None else user_files(data_path)
    train, test = split(read_stream(files).long())
    train_x, train_y = windows_of(train, CONTEXT)
    test_x, test_y = windows_of(test, CONTEXT)
    return Dataset("text", train_x, train_y, test_x, test_y, num_classes=VOCAB, sequence=True)
