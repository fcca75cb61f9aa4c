"""Where each parameter lives in the box's flat float32 buffer: names, shapes, offsets, shards."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


def shard_range(numel: int, k: int, num_shards: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``k`` of ``numel`` elements cut into ``num_shards`` near-equal parts.

    The first ``numel % num_shards`` shards hold one element more (as ``numpy.array_split`` does).

    >>> [shard_range(1001, k, 3) for k in range(3)]
    [(0, 334), (334, 668), (668, 1001)]
    """
    if num_shards < 1 or not 0 <= k < num_shards:
        raise ValueError(f"shard {k} of {num_shards}: need 0 <= k < num_shards")
    base, extra = divmod(numel, num_shards)
    start = k * base + min(k, extra)
    return start, start + base + (1 if k < extra else 0)


def shard_of(numel: int, index: int, num_shards: int) -> int:
    """The shard that holds element ``index`` (inverse of :func:`shard_range`)."""
    base, extra = divmod(numel, num_shards)
    big = extra * (base + 1)  # elements held by the shards that have one more
    if index < big:
        return index // (base + 1)
    return extra + (index - big) // base


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # The fused multi-tensor copy needs every tensor on one device; a GPU model copies one by one.
    if dsts and all(d.device == s.device for d, s in zip(dsts, srcs)):
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs):
            d.copy_(s)


@dataclass(frozen=True)
class Layout:
    """Named tensors packed back to back into one flat float32 buffer.

    >>> lay = Layout.from_shapes([("w", (2, 3)), ("b", (3,))])
    >>> lay.numel, lay.offsets
    (9, (0, 6))
    >>> flat = torch.arange(9.0)
    >>> lay.views(flat)["b"].tolist()  # a view: writing it writes ``flat``
    [6.0, 7.0, 8.0]
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def from_shapes(cls, items: Iterable[tuple[str, Sequence[int]]]) -> Layout:
        names, shapes, offsets, pos = [], [], [], 0
        for name, shape in items:
            size = torch.Size(shape)
            names.append(name)
            shapes.append(size)
            offsets.append(pos)
            pos += size.numel()
        if len(set(names)) != len(names):
            raise ValueError(f"layout names must be unique: {names}")
        return cls(tuple(names), tuple(shapes), tuple(offsets), pos)

    @classmethod
    def from_model(cls, model: nn.Module) -> Layout:
        """The layout of ``model.named_parameters()`` (shared parameters once, in registration order)."""
        return cls.from_shapes((n, p.shape) for n, p in model.named_parameters())

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.numel() for s in self.shapes)

    def fingerprint(self) -> int:
        """A signed 64-bit hash of names and shapes: boxes compare it to refuse a different layout."""
        text = ";".join(f"{n}:{tuple(s)}" for n, s in zip(self.names, self.shapes))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)

    def shard_range(self, k: int, num_shards: int) -> tuple[int, int]:
        return shard_range(self.numel, k, num_shards)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: view of flat shaped like the parameter}``; no copies."""
        self._check(flat)
        return {n: flat[o : o + s.numel()].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"flat buffer has shape {tuple(flat.shape)}; the layout needs ({self.numel},)")

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        named = list(model.named_parameters())
        if [n for n, _ in named] != list(self.names):
            raise ValueError("the model's parameters do not match this layout (names or order differ)")
        return [p for _, p in named]

    def gather_params(self, model: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Copy the model's parameters into ``out`` (flat, ``numel`` long) in one pass; returns ``out``."""
        self._check(out)
        with torch.no_grad():
            torch.cat(
                [p.detach().reshape(-1).to(out.device, out.dtype) for p in self._params(model)], out=out
            )
        return out

    def gather_grads(self, model: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Copy the model's gradients into ``out``; a parameter without ``.grad`` contributes zeros."""
        self._check(out)
        pieces = [
            torch.zeros(p.numel(), dtype=out.dtype) if p.grad is None else p.grad.detach().reshape(-1)
            for p in self._params(model)
        ]
        torch.cat([t.to(out.device, out.dtype) for t in pieces], out=out)
        return out

    def scatter_params(self, flat: torch.Tensor, model: nn.Module) -> None:
        """Copy ``flat`` into the model's parameters (one fused multi-tensor copy)."""
        params = self._params(model)
        with torch.no_grad():
            _copy_all([p.data for p in params], list(self.views(flat).values()))

    def scatter_grads(self, flat: torch.Tensor, model: nn.Module) -> None:
        """Set each parameter's ``.grad`` from ``flat`` (allocating ``.grad`` where it is None)."""
        params = self._params(model)
        for p in params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
        _copy_all([p.grad for p in params], list(self.views(flat).values()))

    def bind_params_(self, model: nn.Module, flat: torch.Tensor, copy_values: bool = False) -> None:
        """Make each parameter a view into ``flat`` (Hogwild: the model lives in the shared box).

        With ``copy_values`` the current weights are first written into ``flat``. The Parameter
        objects stay the same, so an optimizer built before or after keeps working.
        """
        params = self._params(model)
        views = self.views(flat)
        with torch.no_grad():
            for p, view in zip(params, views.values()):
                if copy_values:
                    view.copy_(p.data)
                p.data = view
