"""Test-set metrics: the user's ``metrics(model, batch) -> dict[str, float]`` or the default, averaged
over the test set weighted by batch size.

The default is the run's loss, plus accuracy where the batch is ``(x, y)`` with integer labels and
``model(x)`` gives one row of class logits per label; a regression run gets its loss alone. A
sequence data set (``text``: the loss is ``sequence_loss``, nats per byte) gets ``bits_per_byte``
(loss / ln 2), ``perplexity`` (exp of the mean loss) and ``accuracy`` (of the next byte, top 1). The
result always holds ``loss`` (the run's loss on the test set), whatever the user's metrics return.

>>> m = nn.Linear(2, 3)
>>> sorted(evaluate(m, [(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))], None, default_loss, "cpu"))
['test_accuracy', 'test_loss']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parambox.errors import UserError
from parambox.strategies.tensors import batch_size, map_tensors
from parambox.workload import refs
from parambox.workload.losses import default_loss, sequence_loss

MetricsFn = Callable[[nn.Module, Any], dict[str, Any]]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    metrics: MetricsFn | None,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device | str,
) -> dict[str, float]:
    """``{"test_<name>": mean}`` over ``batches``; empty when there are none."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    n = 0
    try:
        for batch in batches:
            batch = map_tensors(lambda t: t.to(device), batch)
            k = batch_size(batch)
            values = user_metrics(metrics, model, batch) if metrics is not None else {}
            if "loss" not in values:
                values.update(default_metrics(model, batch, loss, with_loss=True))
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value * k
            n += k
    finally:
        model.train(was_training)
    means = {f"test_{name}": total / n for name, total in sums.items()} if n else {}
    if "test_bits_per_byte" in means and metrics is None:
        # exp of the mean loss, not the mean of each batch's exp: the perplexity of the whole test set
        means["test_perplexity"] = math.exp(min(means["test_loss"], 700.0))
    return means


def default_metrics(model: nn.Module, batch: Any, loss: Callable, with_loss: bool = True) -> dict[str, float]:
    """The loss, and accuracy for class logits against integer labels (one forward pass for the
    default cross-entropy)."""
    if getattr(loss, "fn", loss) is sequence_loss:  # also the default loss checked (CheckedLoss)
        return sequence_metrics(model(batch[0]), batch[1])
    labelled = isinstance(batch, tuple | list) and len(batch) == 2 and _is_labels(batch[1])
    if getattr(loss, "fn", loss) is default_loss and labelled:  # also the default loss checked (CheckedLoss)
        out = model(batch[0])
        values = {"loss": float(F.cross_entropy(out, batch[1]))}
        values.update(_accuracy(out, batch[1]))
        return values
    values = {"loss": float(loss(model, batch))} if with_loss else {}
    if labelled:
        values.update(_accuracy(model(batch[0]), batch[1]))
    return values


def sequence_metrics(out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy per position (nats), the same in bits, and top-1 accuracy of the next token.

    >>> m = sequence_metrics(torch.zeros(1, 2, 256), torch.zeros(1, 2, dtype=torch.long))
    >>> round(m["bits_per_byte"], 6), m["accuracy"]
    (8.0, 1.0)
    """
    logits, targets = out.flatten(0, -2), y.flatten().long()
    loss = float(F.cross_entropy(logits, targets))
    accuracy = float((logits.argmax(1) == targets).float().mean())
    return {"loss": loss, "bits_per_byte": loss / math.log(2), "accuracy": accuracy}


def user_metrics(metrics: MetricsFn, model: nn.Module, batch: Any) -> dict[str, float]:
    name = refs.describe(metrics)
    try:
        values = metrics(model, batch)
    except Exception as e:
        raise UserError(
            f"metrics {name} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not isinstance(values, dict):
        raise UserError(f"metrics {name} returned a {type(values).__name__}, not a dict of name -> number")
    out = {}
    for key, value in values.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            raise UserError(f"metrics {name}: {key!r} is a {type(value).__name__}, not a number") from None
    return out


def _is_labels(y: Any) -> bool:
    return (
        isinstance(y, torch.Tensor) and y.dim() == 1 and not y.is_floating_point() and y.dtype != torch.bool
    )


def _accuracy(out: Any, y: torch.Tensor) -> dict[str, float]:
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == len(y) and out.shape[1] > 1:
        return {"accuracy": float((out.argmax(1) == y).float().mean())}
    return {}
