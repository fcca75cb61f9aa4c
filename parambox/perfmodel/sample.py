"""What one training item looks like, so the timed steps of ``parambox predict`` feed a model what it trains on.

A :class:`Sample` is the input's shape and dtype (float images, or integer token ids with their range), the
number of classes and whether the target is one class per item or one per position (``text``: a model of byte
sequences takes ``(B, T)`` token ids and returns ``(B, T, 256)`` logits). It comes from a data set
(:meth:`Sample.of_dataset`) or from ``--input-shape``/``--num-classes`` (float inputs), travels to the measuring
processes as JSON, and draws random batches of that kind there; the step's loss is the data set's default loss.

>>> s = Sample((4,), 256, dtype="uint8", high=255, sequence=True)
>>> x, y = s.batch(2)
>>> x.dtype, tuple(x.shape), tuple(y.shape)
(torch.uint8, (2, 4), (2, 4))
>>> Sample.from_json(s.as_json()) == s
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from parambox.errors import UserError
from parambox.workload import refs
from parambox.workload.losses import default_loss, sequence_loss


@dataclass(frozen=True)
class Sample:
    """One item's input (``shape``, ``dtype``; integer values drawn from ``low..high``) and target."""

    shape: tuple[int, ...]
    num_classes: int
    dtype: str = "float32"
    low: int = 0
    high: int = 0
    sequence: bool = False  # a target per position, (B, *shape), as the input's: the text set's

    @classmethod
    def of_dataset(cls, ds: Any) -> Sample:
        """The shape, dtype and value range of a :class:`parambox.data.Dataset`'s training inputs."""
        x = ds.train_x
        dtype = str(x.dtype).removeprefix("torch.")
        low = high = 0
        if not x.is_floating_point():
            low, high = int(x.min()), int(x.max())
        return cls(tuple(x.shape[1:]), ds.num_classes, dtype, low, high, ds.sequence)

    @classmethod
    def from_json(cls, d: dict) -> Sample:
        return cls(**{**d, "shape": tuple(d["shape"])})

    def as_json(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A random ``(x, y)`` batch of ``size`` items of this kind (seeded by the caller)."""
        dtype = getattr(torch, self.dtype)
        if dtype.is_floating_point:
            x = torch.randn(size, *self.shape, dtype=dtype)
        else:
            x = torch.randint(self.low, self.high + 1, (size, *self.shape), dtype=dtype)
        y = torch.randint(0, self.num_classes, (size, *self.shape) if self.sequence else (size,))
        return x, y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The data set's default loss: cross-entropy per item, or per position for a sequence."""
        return (sequence_loss if self.sequence else default_loss)(model, batch)


def build_measured_model(model: str, sample: Sample) -> nn.Module:
    """A zoo model built for ``sample``, or the module a user's factory (``file.py:fn``) returns."""
    from parambox.models import build_model

    if not refs.is_reference(model):
        try:
            return build_model(model, sample.shape, sample.num_classes)
        except ValueError as e:
            raise UserError(f"--model {model}: {e}") from None
    built = refs.resolve(model, "model")
    try:
        out = built()
    except Exception as e:
        raise UserError(f"model factory {model} {refs.raised(e)}") from e
    if not isinstance(out, nn.Module):
        raise UserError(f"model factory {model} returned a {type(out).__name__}, not a torch.nn.Module")
    return out
