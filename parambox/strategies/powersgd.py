"""PowerSGD (Vogels et al. 2019): a rank-r approximation of each weight matrix's summed gradient,
with error feedback; allreduce's ``compression=powersgd``.

Per matrix-shaped tensor ``M`` (its gradient plus the error it owes, viewed as (rows, -1)), with
``Q`` (columns x r) the same on every rank::

    P = M Q;  allreduce P;  orthogonalize P;  Q = M^T P;  allreduce Q;  M_hat = P Q^T / world
    e = M - M_hat  (kept by this rank, added to its next M);  Q kept for the next round (warm start)

``P Q^T`` is the projection of the ranks' summed ``M`` on the columns of ``P``: the sum, exact when
that sum has rank r or less. Vectors (biases, norms) and matrices too small to gain at least 2x
(torch's ``_should_compress``) go uncompressed in the first allreduce, with the float32 tail (counts,
flags) riding along exact. So a round sends ``4 (sum (rows + cols) r + uncompressed + tail)`` bytes
per rank. The maths (``_orthogonalize``, ``_should_compress``) is PyTorch's, from its DDP
communication hook ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; the hook itself
runs inside DDP, which parambox's allreduce is not.

As with the other encodings, nothing is lost, only late: over rounds, the sum of what was sent
(``P Q^T`` of each round) plus every rank's error still owed is the sum of the gradients.

>>> ps = PowerSGD([torch.Size([8, 6]), torch.Size([8])], rank=1)
>>> m = torch.outer(torch.arange(8.0), torch.ones(6))  # rank 1: carried exactly
>>> total, tail = ps.reduce(torch.cat([m.reshape(-1), torch.ones(8)]), torch.ones(1), lambda t: None, 1)
>>> bool(torch.allclose(total[:48], m.reshape(-1), atol=1e-5)), ps.message_bytes(tail=1)
(True, 92)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

MIN_COMPRESSION_RATE = 2.0  # a matrix is compressed where (rows + cols) r is at most half its size
EPSILON = 1e-8  # orthogonalization of a zero column (a gradient of zeros) gives zeros, not NaN


class PowerSGD:
    """Low-rank sums of a flat float32 tensor laid out as ``shapes`` (back to back), with error feedback.

    ``reduce(x, tail, all_reduce, group_size)`` returns ``(sum_hat, sum tail)`` over the ranks, running
    ``all_reduce`` (an in-place sum over the group) twice. ``seed`` draws the first Q, the same on
    every rank.
    """

    def __init__(
        self,
        shapes: list[torch.Size],
        rank: int,
        device: torch.device | None = None,
        seed: int = 0,
        min_compression_rate: float = MIN_COMPRESSION_RATE,
    ):
        self.numel = sum(s.numel() for s in shapes)
        self.matrices, spans = _split(shapes, rank, min_compression_rate)
        plain = [torch.arange(a, b) for a, b in spans]
        self.rank = rank
        self.plain = (torch.cat(plain) if plain else torch.zeros(0, dtype=torch.long)).to(device)
        generator = torch.Generator().manual_seed(seed)
        self.qs = [
            torch.randn(cols, min(rank, rows), generator=generator).to(device)
            for _, rows, cols in self.matrices
        ]
        self.error = torch.zeros(self.numel, device=device)
        self.bytes_sent = 0  # this rank's last round, both allreduces
        self._kept: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None

    def message_bytes(self, tail: int) -> int:
        """Bytes one rank sends per round (both allreduces) with a float32 tail of ``tail`` elements."""
        return 4 * sum(self.round_elements(tail))

    def round_elements(self, tail: int) -> tuple[int, int]:
        """The float32 elements of a round's two allreduces: the P's, the uncompressed and the tail; the Q's."""
        return _round_elements(self.matrices, self.rank, self.plain.numel(), tail)

    def forget_error_(self) -> None:
        """Owe nothing (a rank new to the run)."""
        self.error.zero_()

    def reduce(
        self,
        x: torch.Tensor,
        tail: torch.Tensor,
        all_reduce: Callable[[torch.Tensor], None],
        group_size: int,
        keep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_hat, sum tail)``; with ``keep``, :meth:`redo` can repeat the round over another group."""
        if keep:
            self._kept = (x.clone(), self.error.clone(), [q.clone() for q in self.qs])
        y = x.reshape(-1) + self.error
        tail = tail.reshape(-1).float()
        ms = [y[o : o + rows * cols].view(rows, cols) for o, rows, cols in self.matrices]
        ps = [m @ q for m, q in zip(ms, self.qs)]
        first = torch.cat([*(p.reshape(-1) for p in ps), y[self.plain], tail])
        all_reduce(first)
        parts = first.split([*(p.numel() for p in ps), self.plain.numel(), tail.numel()])
        ps = [part.view_as(p) for part, p in zip(parts, ps)]
        if ps:
            for p in ps:  # PyTorch's: Gram-Schmidt (r <= 2) or QR, in place
                _orthogonalize(p.unsqueeze(0), EPSILON)
            qs = [m.T @ p for m, p in zip(ms, ps)]
            second = torch.cat([q.reshape(-1) for q in qs])
            all_reduce(second)
            self.qs = [part.view_as(q) for part, q in zip(second.split([q.numel() for q in qs]), qs)]
        total = torch.empty_like(y)
        total[self.plain] = parts[-2]
        for (o, rows, cols), p, q in zip(self.matrices, ps, self.qs):
            total[o : o + rows * cols] = (p @ q.T).reshape(-1)
        torch.sub(y, total / group_size, out=self.error)
        self.error[self.plain] = 0.0  # sent whole
        self.bytes_sent = 4 * (first.numel() + sum(q.numel() for q in self.qs))
        return total, parts[-1].clone()

    def redo(
        self, tail: torch.Tensor, all_reduce: Callable[[torch.Tensor], None], group_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept round again (the error and Q as they were before it), over the group as it is now."""
        assert self._kept is not None, "redo() needs reduce(keep=True)"
        x, error, qs = self._kept
        self.error.copy_(error)
        self.qs = [q.clone() for q in qs]
        return self.reduce(x, tail, all_reduce, group_size, keep=True)

    def state_dict(self) -> dict[str, Any]:
        return {"error": self.error.clone(), "q": [q.clone() for q in self.qs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "error" in state:
            self.error.copy_(state["error"])
        if "q" in state:
            for q, saved in zip(self.qs, state["q"]):
                q.copy_(saved)


def round_elements(shapes: list[torch.Size], rank: int, tail: int = 0) -> tuple[int, int]:
    """:meth:`PowerSGD.round_elements` for tensors of these ``shapes``, with nothing allocated (the simulator's)."""
    matrices, spans = _split(shapes, rank, MIN_COMPRESSION_RATE)
    return _round_elements(matrices, rank, sum(b - a for a, b in spans), tail)


def _split(
    shapes: list[torch.Size], rank: int, min_compression_rate: float
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The compressed matrices ``(offset, rows, columns)`` and the spans sent whole ``(start, end)``."""
    matrices, spans, offset = [], [], 0
    for s in shapes:
        n = math.prod(s)
        rows = s[0] if len(s) >= 2 else 0
        cols = n // rows if rows else 0
        if rows and _should_compress(rows, cols, min(rank, rows, cols), min_compression_rate)[0]:
            matrices.append((offset, rows, cols))
        else:
            spans.append((offset, offset + n))
        offset += n
    return matrices, spans


def _round_elements(
    matrices: list[tuple[int, int, int]], rank: int, plain: int, tail: int
) -> tuple[int, int]:
    first = sum(rows * min(rank, rows, cols) for _, rows, cols in matrices) + plain + tail
    return first, sum(cols * min(rank, rows, cols) for _, rows, cols in matrices)
