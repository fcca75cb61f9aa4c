"""A run's workload: the model, the data, the loss and the metrics, from the zoo or from the user.

Each of ``model``, ``data``, ``loss``, ``metrics`` and ``collate`` is a callable handed in by the
library API (in the process that trains), a zoo / registry name, or a reference string
(``module:function``, ``file.py:function``; see :mod:`parambox.workload.refs`). The user's functions
are checked where they first run, and a problem is one line naming the function:

- ``model()`` -> any ``nn.Module``, called on every rank after seeding (so all start equal);
- ``data()`` -> ``(train, test)`` Datasets, map-style or ``IterableDataset`` streams (test may be None);
- ``loss(model, batch)`` -> a finite scalar tensor (checked on the first step);
- ``metrics(model, batch)`` -> ``dict[str, float]``, averaged over the test set.

A zoo model with a user's data set is built for the shape of the first training item's input and for
the data set's ``num_classes`` attribute (or ``len(classes)``, torchvision style); without either it is
an error, since counting classes would mean reading the whole data set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from parambox.data import BatchSource, Dataset, load_dataset
from parambox.data.base import GlobalBatchSampler
from parambox.errors import UserError, warn
from parambox.models import MODELS, build_model
from parambox.models.registry import data_for, import_builders
from parambox.workload import loader, refs
from parambox.workload.losses import default_loss, sequence_loss

CALLABLE_FIELDS = ("model", "data", "loss", "metrics", "collate")
EVAL_BATCH = 1024  # test batch of the in-memory data sets


def resolve_callables(cfg: Any, given: dict[str, Callable] | None = None) -> dict[str, Callable]:
    """The user's functions of this run: those ``given`` in-process, else the config's references.
    Zoo and registry names are left to :func:`build_workload`."""
    out = dict(given or {})
    for field in CALLABLE_FIELDS:
        value = getattr(cfg, field)
        if field not in out and isinstance(value, str) and refs.is_reference(value):
            out[field] = refs.resolve(value, field)
    return out


class TensorData:
    """A registered in-memory data set: bulk tensor indexing, the fast path (and the numerics fixtures)."""

    def __init__(self, ds: Dataset):
        self.ds = ds
        self.name = ds.name
        self.num_train = len(ds.train_y)
        self.has_test = len(ds.test_y) > 0
        self.default_loss = sequence_loss if ds.sequence else default_loss

    def model_shape(self) -> tuple[tuple[int, ...], int]:
        return self.ds.input_shape, self.ds.num_classes

    def batch_source(
        self, batch_size: int, rank: int, world_size: int, seed: int, augment: bool | None, pin: bool = False
    ) -> BatchSource:
        augment = augment if augment is not None else self.ds.augment is not None
        return BatchSource(self.ds, batch_size, rank, world_size, seed, augment)

    def test_batches(self) -> Iterator[Any]:
        for i in range(0, len(self.ds.test_y), EVAL_BATCH):
            yield self.ds.test_x[i : i + EVAL_BATCH], self.ds.test_y[i : i + EVAL_BATCH]


class UserData:
    """A user's ``(train, test)`` map-style Datasets, read by a DataLoader with background workers."""

    def __init__(self, train: Any, test: Any, name: str, collate: Callable | None, loader_workers: int):
        self.train, self.test, self.name = train, test, name
        self.collate = collate or default_collate
        self.loader_workers = loader_workers
        self.stream = loader.is_stream(train)  # an IterableDataset: its length is not known
        self.num_train: int | None = None if self.stream else len(train)
        self.has_test = test is not None and (loader.is_stream(test) or len(test) > 0)
        self.eval_batch = 256
        self.default_loss = default_loss

    def model_shape(self) -> tuple[tuple[int, ...], int]:
        item = loader.first_item(self.train, self.name)
        # The input is the first part of an (x, y) item, the first value of a dict item, or the item.
        x = (
            item[0]
            if isinstance(item, tuple | list)
            else next(iter(item.values()))
            if isinstance(item, dict)
            else item
        )
        classes = getattr(self.train, "num_classes", None)
        if classes is None and hasattr(self.train, "classes"):
            classes = len(self.train.classes)
        if classes is None:
            raise UserError(
                f"a zoo model on data {self.name} needs the number of classes: give the training Dataset a "
                "num_classes attribute, or pass your own model factory"
            )
        return tuple(loader.as_float_tensor(x).shape), int(classes)

    def batch_source(
        self, batch_size: int, rank: int, world_size: int, seed: int, augment: bool | None, pin: bool = False
    ) -> loader.LoaderSource:
        if augment:
            warn(f"augment applies to the registered data sets; data {self.name} is used as it is")
        sampler = GlobalBatchSampler(self.num_train, batch_size, rank, world_size, seed)
        source = loader.StreamSource if self.stream else loader.LoaderSource
        return source(self.train, sampler, self.collate, self.name, self.loader_workers, pin)

    def test_batches(self) -> Iterator[Any]:
        if not self.has_test:
            return iter(())
        return loader.test_batches(self.test, self.eval_batch, self.collate, self.name, self.loader_workers)


@dataclass
class Workload:
    """What the training loop trains: built once per rank by :func:`build_workload`."""

    data: TensorData | UserData
    model_name: str
    model_fn: Callable[[], Any] | None  # None: the zoo model ``model_name``
    loss: Callable[[nn.Module, Any], torch.Tensor]
    metrics: Callable[[nn.Module, Any], dict[str, Any]] | None  # None: the default metrics

    def build_model(self) -> nn.Module:
        """The model, checked; call it after seeding, on every rank."""
        if self.model_fn is None:
            self._check_sequence_model()
            shape, classes = self.data.model_shape()
            try:
                return build_model(self.model_name, shape, classes)
            except ValueError as e:
                raise UserError(str(e)) from None
        name = refs.describe(self.model_fn)
        try:
            model = self.model_fn()
        except Exception as e:
            raise UserError(f"model factory {name} raised {loader._one_line(e)}") from e
        if not isinstance(model, nn.Module):
            raise UserError(f"model factory {name} returned a {type(model).__name__}, not a torch.nn.Module")
        if not any(p.requires_grad for p in model.parameters()):
            raise UserError(
                f"model factory {name} returned a model with no trainable parameters: nothing to train"
            )
        return model

    def _check_sequence_model(self) -> None:
        """A sequence data set (``text``) needs a zoo model that reads byte sequences."""
        if self.data.default_loss is not sequence_loss or data_for(self.model_name) == self.data.name:
            return
        fitting = sorted(m for m in MODELS if data_for(m) == self.data.name)
        raise UserError(
            f"model {self.model_name!r} does not read byte sequences: data {self.data.name!r} needs "
            f"{', '.join(fitting) or 'a sequence model'}, or your own model factory"
        )


def build_workload(cfg: Any, given: dict[str, Callable] | None = None) -> Workload:
    """The run's workload from its config and the in-process callables ``given`` (the library API)."""
    fns = resolve_callables(cfg, given)
    data = load_data(cfg, fns.get("data"), fns.get("collate"))
    model_fn = fns.get("model")
    if model_fn is None:
        import_builders()
        if cfg.model not in MODELS:
            raise UserError(f"unknown model {cfg.model!r}; choose from {', '.join(sorted(MODELS))}")
    loss_fn = fns.get("loss")
    if loss_fn is not None:
        loss: Callable = CheckedLoss(loss_fn, f"loss {refs.describe(loss_fn)}")
    elif model_fn is not None or fns.get("data") is not None:  # a user's model or data: may not fit it
        what = "the default loss (cross-entropy of model(x) against y" + (
            ", per position)" if data.default_loss is sequence_loss else ")"
        )
        loss = CheckedLoss(data.default_loss, what)
    else:
        loss = data.default_loss
    return Workload(data, cfg.model, model_fn, loss, fns.get("metrics"))


def load_data(cfg: Any, data_fn: Callable | None, collate: Callable | None) -> TensorData | UserData:
    if data_fn is None:
        if collate is not None:
            warn(f"collate applies to a user's data sets; data {cfg.data} is batched in memory")
        return TensorData(load_dataset(cfg.data, cfg.data_path, cfg.seed))
    name = refs.describe(data_fn)
    try:
        result = data_fn()
    except Exception as e:
        raise UserError(f"data factory {name} raised {loader._one_line(e)}") from e
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise UserError(
            f"data factory {name} returned a {type(result).__name__}; expected (train, test) "
            "Datasets, map-style or IterableDatasets (test may be None)"
        )
    train, test = result
    if train is None:
        raise UserError(f"data factory {name} returned no training set (train is None; test may be)")
    for part, ds in (("train", train), ("test", test)):
        if ds is not None and not (loader.is_map_style(ds) or loader.is_stream(ds)):
            raise UserError(
                f"data factory {name}: its {part} set is a {type(ds).__name__}, neither a map-style Dataset "
                "(__getitem__ and __len__) nor an IterableDataset"
            )
    if not loader.is_stream(train) and len(train) == 0:
        raise UserError(f"data factory {name}: the training set is empty")
    return UserData(train, test, name, collate, cfg.loader_workers)


def check_batch_fits(data: TensorData | UserData, batch_size: int, num_ranks: int) -> None:
    """A global batch larger than the training set would repeat items within one step."""
    if data.num_train is not None and batch_size * num_ranks > data.num_train:
        per = f"batch_size {batch_size} x {num_ranks} data-parallel workers = {batch_size * num_ranks}"
        raise UserError(
            f"{per if num_ranks > 1 else f'batch_size {batch_size}'} is more than the "
            f"{data.num_train} training items of data {data.name}"
        )


class CheckedLoss:
    """A loss checked on its first call: a finite scalar tensor that depends on the model's
    parameters (where gradients are on), or a one-line error. ``name``: the loss in messages
    (``loss my_loss``, or the default loss with a user's model or data, which may not fit it)."""

    def __init__(self, fn: Callable[[nn.Module, Any], Any], name: str):
        self.fn, self.name, self.checked = fn, name, False

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.checked:
            return self.fn(model, batch)
        try:
            loss = self.fn(model, batch)
        except UserError:
            raise
        except Exception as e:  # on the first step: the loss does not fit the model or batch
            raise UserError(f"{self.name} raised {loader._one_line(e)} on the first step") from e
        self._check(loss)
        self.checked = True
        return loss

    def _check(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            raise UserError(f"{self.name} returned a {type(loss).__name__}, not a scalar tensor")
        if loss.numel() != 1:
            raise UserError(
                f"{self.name} returned a tensor of shape {tuple(loss.shape)}, not a scalar "
                "(reduce it, e.g. .mean())"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise UserError(
                f"{self.name} does not depend on the model's parameters (no gradient flows back: a "
                "constant, or .detach()/.item() inside it)"
            )
        value = float(loss.detach())
        if value != value or value in (float("inf"), float("-inf")):
            raise UserError(f"{self.name} is {value} on the first step: not finite")
