"""Streaming DiLoCo's fragments: the flat global state cut in ``F`` pieces, each with its own schedule.

Douillard et al. 2025, *Streaming DiLoCo with overlapping communication*; torchft's ``DiLoCo`` with
``fragment_sync_delay`` and ``fragment_update_alpha``. A :class:`Fragment` is a contiguous slice
``[start, stop)`` of the flat vector (the parameters, then the float buffers), cut at element
boundaries so that every fragment carries the same number of elements to within one: the link
carries ``1/F`` of the model per exchange whatever the sizes of the model's tensors (the outer
optimizer is elementwise, so where the cuts fall changes nothing in the maths).

Fragment ``f`` of ``F`` sends its pseudo-gradient after the steps ``t`` (steps done, ``t >= 1``)
with ``t % H == offset(f)``, ``offset(f) = H f // F`` (fragment 0 with the whole model's rounds), and
its outer step lands ``delay`` steps later.

>>> [(f.start, f.stop, f.offset) for f in cut(10, fragments=3, inner_steps=6)]
[(0, 3, 0), (3, 6, 2), (6, 10, 4)]
>>> frag = cut(10, 3, 6)[1]
>>> [t for t in range(1, 15) if frag.sends_after(t)], frag.steps_since_send(13)
([2, 8, 14], 5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Fragment:
    """One slice of the flat state and its place in the round of ``inner_steps`` (H) steps."""

    index: int
    start: int
    stop: int
    offset: int  # sends after the steps t with t % H == offset
    inner_steps: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def sends_after(self, t: int) -> bool:
        """Its exchange begins after ``t`` steps done (``t >= 1``)."""
        return t >= 1 and t % self.inner_steps == self.offset

    def steps_since_send(self, t: int) -> int:
        """Steps done since its last exchange began, after ``t`` steps (all of them if none has)."""
        if t < max(self.offset, 1) or (self.offset == 0 and t < self.inner_steps):
            return t
        return (t - self.offset) % self.inner_steps


def cut(numel: int, fragments: int, inner_steps: int) -> list[Fragment]:
    """``fragments`` slices of ``numel`` elements, sizes within one of each other, offsets ``H f // F``."""
    bounds = [numel * f // fragments for f in range(fragments + 1)]
    return [
        Fragment(f, bounds[f], bounds[f + 1], inner_steps * f // fragments, inner_steps)
        for f in range(fragments)
    ]


def read_slice(tensors: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the tensors laid end to end (a copy)."""
    parts, pos = [], 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            parts.append(t.detach().reshape(-1)[lo - pos : hi - pos])
        pos += n
    return torch.cat(parts) if parts else torch.empty(0)


def write_slice_(tensors: Sequence[torch.Tensor], start: int, values: torch.Tensor) -> None:
    """Copy ``values`` into the tensors laid end to end, from element ``start`` on (in place)."""
    stop, pos = start + values.numel(), 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi and t.is_contiguous():
                t.view(-1)[lo - pos : hi - pos].copy_(values[lo - start : hi - start])
            elif lo < hi:  # (a channels_last or transposed parameter: no flat view of it)
                whole = t.reshape(-1).clone()
                whole[lo - pos : hi - pos] = values[lo - start : hi - start]
                t.copy_(whole.view(t.shape))
            pos += n
