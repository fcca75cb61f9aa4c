"""How the data-parallel rules see their gradients during backward: as views into a flat buffer
(:class:`GradViews`, :func:`bind_flat_replica`), bucket by bucket as backward finishes them
(:class:`FinishedTail`, :func:`step_only`), and pass by pass for the rules that average by the end of
backward (:class:`BackwardPasses`).

>>> t = FinishedTail([0, 4, 6, 10], bucket=4)
>>> t.finish(2)
(range(2, 3), 6, 10)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parambox.box import Layout
from parambox.runtime.elastic import PeerLost

if TYPE_CHECKING:
    from parambox.strategies.base import Strategy


class BackwardPasses:
    """A step's backward passes, for the rules whose ``.grad`` is averaged when ``backward()`` returns
    (DDP's contract: clipping, ``GradScaler.unscale_`` and inf checks between backward and the step see
    the averaged gradient).

    A pass communicates (``syncs``) unless it runs inside :meth:`no_sync` or is one of the first
    ``backward_passes_per_step - 1`` of the step; those accumulate locally. ``on_end(syncs)`` runs at
    the end of every pass (an autograd callback, queued by the pass's first gradient: the hooks are
    registered before any other on the parameters, so ``syncs`` is known when theirs run). A peer lost
    while a pass communicates is kept (``lost``) for the step's exchange to answer by regrouping:
    raised from a callback it would surface from the user's ``backward()``.
    """

    def __init__(self, owner: Strategy, params: list[nn.Parameter], on_end: Callable[[bool], None]):
        self.owner, self.on_end, self.params = owner, on_end, params
        self.local_only = False
        self._handles = [p.register_post_accumulate_grad_hook(self._first_gradient) for p in params]
        self.reset()

    def reset(self) -> None:
        """A new step: no pass yet."""
        self.passes = 0  # passes finished
        self.syncs: bool | None = None  # whether the pass under way communicates (None: none under way)
        self.synced = False  # a pass communicated since the step began or the loop last cleared .grad
        self.exchanged = False  # a pass of this step communicated
        self.lost: PeerLost | None = None
        self._left: list[torch.Tensor | None] = []  # the .grad as the last communicating pass left them

    def clear(self) -> None:
        """The loop zeroed ``.grad`` in the middle of the step (``opt.zero_grad()`` after a backward,
        before ``step()``): what the passes so far accumulated is gone, the next one starts afresh."""
        self.passes, self.synced = 0, False

    def _dropped(self) -> bool:
        """No parameter holds the ``.grad`` the last communicating pass left: the loop dropped them
        (a module's ``zero_grad()``, as a GAN's loop calls it), and this pass's are a new accumulation."""
        return all(left is None or p.grad is not left for p, left in zip(self.params, self._left))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.local_only = self.local_only, True
        try:
            yield
        finally:
            self.local_only = before

    def _first_gradient(self, p: torch.Tensor) -> None:
        if self.syncs is None:
            self.syncs = not self.local_only and self.passes + 1 >= self.owner.backward_passes_per_step
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        syncs, self.syncs = self.syncs, None
        self.passes += 1
        if syncs and self.synced and self._dropped():
            self.clear()
        try:
            self.on_end(bool(syncs))
        except PeerLost as e:
            self.lost = e
        if syncs:
            self.synced = self.exchanged = True
            self._left = [p.grad for p in self.params]

    def raise_lost(self) -> None:
        """In the step's exchange: a peer lost during the last pass's communication, if any."""
        lost, self.lost = self.lost, None
        if lost is not None:
            raise lost

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class GradViews:
    """The trainable parameters' ``.grad`` as views into a strategy's buffers.

    Backward then accumulates straight into the buffers. ``rebind_()`` (in ``begin_step``) restores
    the views a user's ``optimizer.zero_grad(set_to_none=True)`` dropped. With ``track``, a
    post-accumulate hook per parameter notes which parameters got a gradient this step (``used``),
    moves a gradient that autograd put elsewhere into its view, and calls ``on_ready(i, first)``;
    ``close()`` removes the hooks, since a user's model outlives the strategy.

    >>> lin = nn.Linear(2, 1); flat = torch.zeros(3)
    >>> gv = GradViews(list(lin.parameters()), [flat[:2].view(1, 2), flat[2:]], track=True)
    >>> lin(torch.ones(1, 2)).sum().backward(); flat.tolist(), gv.used
    ([1.0, 1.0, 1.0], [True, True])
    >>> gv.close()
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        views: list[torch.Tensor],
        track: bool = False,
        on_ready: Callable[[int, bool], None] | None = None,
    ):
        self.params, self.views, self.on_ready = params, views, on_ready
        self.used = [False] * len(params)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params) if track
        ]
        self.rebind_()

    @classmethod
    def of_flat(cls, model: nn.Module, layout: Layout, flat: torch.Tensor, **kw: Any) -> GradViews:
        """Views into ``flat`` laid out as ``layout`` (every parameter), bound for the trainable ones."""
        pairs = [(p, v) for p, v in zip(model.parameters(), layout.views(flat).values()) if p.requires_grad]
        return cls([p for p, _ in pairs], [v for _, v in pairs], **kw)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            first = not self.used[i]
            self.used[i] = True
            view = self.views[i]
            if p.grad is not view:
                # The .grad was dropped after begin_step (a module's zero_grad(), which sets None) and
                # autograd made a new one: it holds the whole gradient since the drop, the view's content
                # is what the loop threw away.
                view.copy_(p.grad)
                p.grad = view
            if self.on_ready is not None:
                self.on_ready(i, first)

        return ready

    def rebind_(self) -> None:
        """Every trainable parameter's ``.grad`` is its view again; ``used`` starts over."""
        self.used = [False] * len(self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def settle_(self) -> None:
        """Before the rule reads the buffers (hookless views): a ``.grad`` the loop dropped after the
        step began (a module's ``zero_grad()``) and backward made anew goes into its view; one dropped
        and not made again leaves a zero there (and ``.grad = None``: plain PyTorch skips it).

        >>> lin = nn.Linear(2, 1); flat = torch.zeros(3)
        >>> gv = GradViews(list(lin.parameters()), [flat[:2].view(1, 2), flat[2:]])
        >>> lin(torch.ones(1, 2)).sum().backward(); lin.zero_grad(); lin(2 * torch.ones(1, 2)).sum().backward()
        >>> gv.settle_(); flat.tolist()
        [2.0, 2.0, 1.0]
        """
        for p, view in zip(self.params, self.views):
            if p.grad is view:
                continue
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = view

    def drop_unused_(self, got_gradient: list[bool] | list[float]) -> None:
        """``.grad = None`` where no gradient came (plain PyTorch then skips the parameter)."""
        for p, got in zip(self.params, got_gradient):
            if not got:
                p.grad = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            p.grad = None


class FinishedTail:
    """The finished tail of a flat buffer during backward, handed out in buckets of at least ``bucket``.

    The parameters sit in the buffer in order (``offsets[i]``: parameter ``i``'s start, the last entry
    the buffer's end) and backward finishes them roughly last to first, so the finished tail grows
    down; ``finish(i)`` returns the next bucket once it holds ``bucket`` elements: ``(params, lo,
    hi)``, the indices of its parameters and the buffer's ``[lo, hi)``.

    >>> t = FinishedTail([0, 4, 6, 10], bucket=4)
    >>> t.finish(2), t.finish(0), t.finish(1), t.cut
    ((range(2, 3), 6, 10), None, (range(0, 2), 0, 6), 0)
    """

    def __init__(self, offsets: list[int], bucket: int):
        self.offsets, self.bucket = offsets, bucket
        self.reset()

    def reset(self) -> None:
        """A new backward: nothing finished; ``cut``: where the buckets handed out so far begin."""
        n = len(self.offsets) - 1
        self.finished, self.tail, self.cut, self.cut_param = [False] * n, n, self.offsets[-1], n

    def finish(self, i: int) -> tuple[range, int, int] | None:
        self.finished[i] = True
        while self.tail > 0 and self.finished[self.tail - 1]:
            self.tail -= 1
        lo = self.offsets[self.tail]
        if self.cut - lo < self.bucket:
            return None
        bucket = (range(self.tail, self.cut_param), lo, self.cut)
        self.cut, self.cut_param = lo, self.tail
        return bucket


def bind_flat_replica(
    model: nn.Module, layout: Layout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the parameters views into one flat buffer ``x`` and their ``.grad`` views into ``g``.

    Pulls, pushes and elastic updates are then single flat operations; backward accumulates
    straight into ``g`` (zero it, not the optimizer's ``zero_grad``, which would drop the views).
    Frozen parameters (``requires_grad=False``) get no ``.grad``: an optimizer never moves them,
    not even by weight decay; their part of ``g`` stays zero.
    """
    x = torch.empty(layout.numel, device=device)
    layout.bind_params_(model, x, copy_values=True)
    g = torch.zeros_like(x)
    GradViews.of_flat(model, layout, g)
    return x, g


def step_only(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], chosen: range) -> None:
    """``optimizer``'s step of ``params[j]`` for ``j`` in ``chosen`` alone: the others' ``.grad`` are
    hidden meanwhile. Every optimizer of ``torch.optim`` but LBFGS is elementwise and skips a
    parameter without a gradient, so stepping a model bucket by bucket is one step; inside backward
    too (PyTorch's optimizer-in-backward), on the parameters whose gradients are done.

    >>> a, b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    >>> a.grad, b.grad = torch.ones(1), torch.ones(1)
    >>> step_only(torch.optim.SGD([a, b], lr=0.5), [a, b], range(1, 2))
    >>> float(a), float(b)
    (1.0, 0.5)
    """
    if not chosen:
        return
    hidden = [(p, p.grad) for j, p in enumerate(params) if j not in chosen and p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad
