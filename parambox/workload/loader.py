"""A user's ``Dataset``s as training batches and test batches: map-style, or streams (``IterableDataset``).

The global batch at step t is the one ``GlobalBatchSampler`` picks (data-parallel rank r takes slice
r), whatever the number of workers, so resuming needs only t. The items are read by a
``torch.utils.data.DataLoader`` whose batch sampler yields the sampler's indices step after step, with
``loader_workers`` background processes, so a slow dataset (decoding, augmentation) is loaded while
the model computes. The first batch is loaded in the training process itself: an item that raises or
items that cannot be collated are then reported as one line naming the data set, not as a
DataLoader worker's traceback. A stream's global batch at step t is the same span of its items
(:class:`StreamSource`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.util
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import Dataset as TorchDataset

from parambox.data.base import GlobalBatchSampler
from parambox.errors import UserError
from parambox.runtime import scratch

Collate = Callable[[list[Any]], Any]
PREFETCH_BATCHES = 4  # per background worker: enough to ride out a slow item or two
SCRATCH_PREFIX = "parambox-loaders-"
# A loader's listening socket is <scratch>/pymp-XXXXXXXX/listener-XXXXXXXX: at most 107 bytes.
_LONGEST_SCRATCH = 107 - len("/pymp-12345678/listener-12345678")


_FROM_A_LOADER = f"{UserError.__module__}.{UserError.__qualname__}: "  # as a DataLoader reraises it


class _Steps:
    """A DataLoader batch sampler: the sampler's indices for ``start``, ``start + 1``, ... (endless)."""

    def __init__(self, sampler: GlobalBatchSampler, start: int):
        self.sampler, self.start = sampler, start

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.sampler.indices(step).tolist()
            step += 1


class LoaderSource:
    """Batches of a user's ``Dataset`` for one data-parallel rank: ``batch(step)``, steps in order.

    >>> # src = LoaderSource(ds, GlobalBatchSampler(len(ds), 16, 0, 1, 0), collate, "make_data", 2)
    >>> # x, y = src.batch(0)
    """

    def __init__(
        self,
        dataset: TorchDataset,
        sampler: GlobalBatchSampler,
        collate: Collate,
        name: str,
        num_workers: int,
        pin_memory: bool = False,
    ):
        self.dataset, self.sampler, self.collate, self.name = dataset, sampler, collate, name
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._it: Iterator[Any] | None = None
        self._next = -1

    def batch(self, step: int) -> Any:
        if step != self._next or self._it is None:
            return self._restart(step)
        self._next = step + 1
        try:
            return next(self._it)
        except Exception as e:
            line = _last_line(e)
            if isinstance(e, UserError) and "\n" not in str(e):  # read here: it names the data set
                raise
            if line.startswith(_FROM_A_LOADER):  # a background reader's own one line
                raise UserError(line.removeprefix(_FROM_A_LOADER)) from e
            raise UserError(f"data {self.name}: loading the batch of step {step} failed: {line}") from e

    def _restart(self, step: int) -> Any:
        """Start the background workers on ``step + 1`` onwards, and load ``step`` here meanwhile."""
        self.close()
        if self.num_workers > 0:
            scratch_dir()
            self._it = iter(
                DataLoader(
                    **self._reader(step + 1),
                    collate_fn=self.collate,
                    prefetch_factor=PREFETCH_BATCHES,
                    pin_memory=self.pin_memory,
                    multiprocessing_context=_fork_context(),
                    worker_init_fn=_init_loader_process,
                )
            )
        else:
            self._it = self._in_process(step + 1)
        self._next = step + 1
        try:  # here: a bad item or batch is one line
            return next(self._in_process(step))
        except BaseException:
            self.close()
            raise

    def _reader(self, start: int) -> dict[str, Any]:
        """What the background workers read from step ``start`` on (a DataLoader's arguments)."""
        return {
            "dataset": self.dataset,
            "batch_sampler": _Steps(self.sampler, start),
            "num_workers": self.num_workers,
        }

    def _in_process(self, start: int) -> Iterator[Any]:
        """The batches of step ``start`` on, read in this process."""
        return (self.load(self.sampler.indices(s).tolist()) for s in _count(start))

    def load(self, indices: list[int]) -> Any:
        """The collated items at ``indices``, read in this process; bad items are the user's error."""
        return load_items(self.dataset, indices, self.collate, self.name)

    def close(self) -> None:
        """Stop the background workers (they hold a copy of the process)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class StreamSource(LoaderSource):
    """Batches of a user's ``IterableDataset`` for one data-parallel rank. The stream is the data set's
    items pass after pass (a new ``iter()`` where one ends); the global batch at step t is the
    sampler's span of it, whatever the number of workers, as for a map-style set, and this rank takes
    its slice. A restart at step t (a resume, a new cut) reads the stream from its start, skipping the
    items before t's. One background process reads it while the model computes."""

    def _reader(self, start: int) -> dict[str, Any]:
        # each element is one step's items, collated as a batch; one reader: a stream has one order
        slices = _Slices(self.dataset, self.sampler, start, self.name)
        return {"dataset": slices, "batch_size": None, "num_workers": 1}

    def _in_process(self, start: int) -> Iterator[Any]:
        slices = _Slices(self.dataset, self.sampler, start, self.name)
        return (collate_items(items, self.collate, self.name) for items in slices)


class _Slices(IterableDataset):
    """This rank's items of each step from ``start`` on, a list a step, read from the stream in order."""

    def __init__(self, dataset: Any, sampler: GlobalBatchSampler, start: int, name: str):
        self.dataset, self.sampler, self.start, self.name = dataset, sampler, start, name

    def __iter__(self) -> Iterator[list[Any]]:
        items, pos = self._stream(), 0
        for step in _count(self.start):
            lo, hi = self.sampler.span(step)
            next(itertools.islice(items, lo - pos, lo - pos), None)  # other ranks' items, earlier steps'
            yield list(itertools.islice(items, hi - lo))
            pos = hi

    def _stream(self) -> Iterator[Any]:
        read = 0
        while True:
            before = read
            try:
                for item in self.dataset:
                    read += 1
                    yield item
            except Exception as e:
                raise UserError(
                    f"data {self.name}: reading item {read} of the stream raised {_one_line(e)}"
                ) from e
            if read == before:
                raise UserError(
                    f"data {self.name}: the training stream yields no items"
                    + (
                        " on its next pass: its __iter__ must start it again (a run reads it pass after pass)"
                        if read
                        else ""
                    )
                )


def _init_loader_process(_worker_id: int) -> None:
    """In a loader process, first thing: its connections dropped, its temporary files in its
    maker's scratch folder."""
    _drop_network_sockets()
    if _scratch is not None:
        path, fd, _ = _scratch
        # multiprocessing's pymp-* folder (the Unix socket that hands the batches' shared-memory
        # descriptors over) is made on first use, after this: inside the scratch folder.
        tempfile.tempdir = path
        # The last of the rank and its loaders to end removes the folder (a rank killed mid-run).
        multiprocessing.util.Finalize(None, _leave_scratch, args=(path, fd), exitpriority=-200)


def _drop_network_sockets() -> None:
    """Close the TCP sockets a loader process inherited from its worker (the process group's
    connections, the store's). A copy left open here keeps a connection up after the worker closed
    it, so a peer blocked on it waits for ``--timeout`` instead of failing at once (a run surviving
    in place regrouped 20 s late when a worker with loaders closed its group). Pipes and Unix
    sockets, which the loader uses itself, stay."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing to do
        return
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
            family = probe.family
            probe.close()
            if family in (socket.AF_INET, socket.AF_INET6):
                os.close(fd)


def load_items(dataset: TorchDataset, indices: list[int], collate: Collate, name: str) -> Any:
    items = []
    for i in indices:
        try:
            items.append(dataset[i])
        except Exception as e:
            raise UserError(f"data {name}: reading item {i} raised {_one_line(e)}") from e
    return collate_items(items, collate, name)


def collate_items(items: list[Any], collate: Collate, name: str) -> Any:
    try:
        return collate(items)
    except Exception as e:
        what = getattr(collate, "__qualname__", "collate")
        raise UserError(f"data {name}: items cannot be batched by {what}: {_one_line(e)}") from e


def test_batches(
    dataset: TorchDataset, batch_size: int, collate: Collate, name: str, num_workers: int
) -> Iterator[Any]:
    """The test set in order, ``batch_size`` items at a time (a stream: one pass of it)."""
    if is_stream(dataset):
        items = iter(dataset)
        while chunk := list(itertools.islice(items, batch_size)):
            yield collate_items(chunk, collate, name)
        return
    n = len(dataset)  # type: ignore[arg-type]
    if num_workers == 0:
        for start in range(0, n, batch_size):
            yield load_items(dataset, list(range(start, min(n, start + batch_size))), collate, name)
        return
    scratch_dir()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=num_workers,
        multiprocessing_context=_fork_context(),
        worker_init_fn=_init_loader_process,
    )
    it = iter(loader)
    try:
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except Exception as e:
                raise UserError(f"data {name}: loading a test batch failed: {_last_line(e)}") from e
            yield batch
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


# This process's loader scratch folder: (path, the descriptor that holds its lock, the maker's pid).
_scratch: tuple[str, int, int] | None = None
_scratch_at_exit = [0]  # the pid that registered remove_scratch at exit


def scratch_dir() -> str | None:
    """The folder this process's data-loader processes make their temporary files in, made on first
    use: multiprocessing's pymp-* folders, which a loader killed before its exit handlers (a rank
    killed with its loaders, under ``mpiexec`` or ``srun``) used to leave in /tmp. None where the
    temporary directory's path is too long to nest one more folder in it (a Unix socket's path
    holds 107 bytes): the loaders then make theirs where they always did.

    The folder is locked (``flock``) while its maker or any of its loaders lives. ``remove_scratch``
    removes it when the run's loaders are stopped; the last of the maker and its loaders to end
    removes it otherwise; and one whose lock is free (all of them killed) is removed by the next
    parambox process on that machine that makes or removes a scratch folder."""
    global _scratch
    if _scratch is None or _scratch[2] != os.getpid():  # a forked child makes its own
        _scratch = None
        if len(tempfile.gettempdir()) + len(f"/{SCRATCH_PREFIX}12345678") > _LONGEST_SCRATCH:
            return None
        path, fd = scratch.make(SCRATCH_PREFIX)
        if _scratch_at_exit[0] != os.getpid():  # once a process: a normal exit (a rank's os._exit
            _scratch_at_exit[0] = os.getpid()  # comes after train() removed it)
            atexit.register(remove_scratch)
        _scratch = (path, fd, os.getpid())
    return _scratch[0]


def remove_scratch() -> None:
    """Remove this process's scratch folder (its loaders stopped), and any abandoned one."""
    global _scratch
    mine, _scratch = _scratch, None
    if mine is not None and mine[2] == os.getpid():
        scratch.remove(*mine[:2])
    scratch.sweep(SCRATCH_PREFIX)


def _leave_scratch(path: str, fd: int) -> None:
    """A loader's exit: drop its copy of the lock, and remove the folder if nobody else holds it."""
    with contextlib.suppress(OSError):
        os.close(fd)
    scratch.remove_if_unlocked(path)


def _count(start: int) -> Iterator[int]:
    while True:
        yield start
        start += 1


def _fork_context():
    # fork: the workers inherit the data set and the user's classes as they are in memory, with no
    # pickling of either (the main script may not even be importable by name).
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


def _one_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _last_line(e: BaseException) -> str:
    # A DataLoader worker's error arrives as "Caught X in DataLoader worker ... Original Traceback ...";
    # its last line is the original "ValueError: ..." itself.
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def is_map_style(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def is_stream(obj: Any) -> bool:
    return isinstance(obj, IterableDataset)


def first_item(dataset: TorchDataset, name: str) -> Any:
    try:
        return next(iter(dataset)) if is_stream(dataset) else dataset[0]
    except StopIteration:
        raise UserError(f"data {name}: the training stream yields no items") from None
    except Exception as e:
        raise UserError(f"data {name}: reading item 0 raised {_one_line(e)}") from e


def as_float_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
