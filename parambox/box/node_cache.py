"""The asynchronous center in two levels (ShmCaffe): each node caches it in its shm box, one exchange a node.

Across nodes with several workers per node, an asynchronous worker's pushes and pulls of the center go
to its node's shm box (memory speed); the node's accumulated update crosses the link once for every
``pushers`` pushes made on the node, so a node's link carries one push and one pull of the center per
round of its workers, whether it runs one worker or eight (ShmCaffe's hybrid, SHM-Learn-Dist's node
level). Counters, barriers and everything past the center (``cached``: a strategy's own region of the
box) go straight to the cross-node box, as before.

The node's box holds the node's view ``V`` of the center and ``G``, the global center as the node last
saw it; always ``V = G + P``, ``P`` the node's pushes not yet sent. A sync (the node's lock held, one
at a time; a push that finds it taken leaves its update for the next)::

    S = V; U = S - G; k += 1   # a snapshot (pushes go on meanwhile); the update, kept in the node's box
    G' = cross.push_pull_once(U, origin=node, seq=k)   # the update out, the global center back
    V += G' - S                # atomic against pushes: what they added since S stays
    G = G'

No update is lost or counted twice, per element: a push that lands before the snapshot is in ``S - G``
and goes out now; one after it stays in ``V - G'`` for the next sync. A sync cut short (its process died
or timed out after some chunks of ``U`` reached the server) leaves ``U`` and ``k`` pending in the node's
box: the node's next sync, by any node-mate, first sends that ``U`` again under the same ``k`` (``S = G +
U``), and the memory server applies each chunk once per ``(node, k)`` (``ServerBox.push_pull_once``), so
the chunks that had landed are not added twice; then it syncs as usual. (Over MPI windows, ``box.server
= false``, there is no once-only exchange: a resent chunk that had landed counts twice.) A node that has not synced yet
does so before its first pull, so a write of the center (rank 0's at the start, a resume's) reaches
every node before anyone reads it; a later write reaches a node at its next sync (its own pushes kept).

An asynchronous worker syncs its node once more before it says it is done, and rank 0 once more before
it takes the result (``ParameterBox.sync_levels``), so the result holds every node's last updates.

Staleness: a pull sees the global center as of the node's last sync plus its node-mates' pushes since,
at most ``pushers`` pushes of the node behind the cross box (asynchronous SGD's bounded staleness).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from parambox.box.base import DONE, BoxConfig, Count, Handle, ParameterBox, open_box
from parambox.runtime.world import World

_SYNCS, _PUSHES, _PUSHERS, _SEQ, _PENDING = range(5)  # the node box's counters


def applies(box: BoxConfig, world: World) -> bool:
    """Two levels for the center: the rma box across nodes, several ranks a node, not switched off."""
    return (
        box.backend == "rma"
        and box.two_level is not False
        and world.num_nodes > 1
        and world.local_world_size > 1
    )


class NodeCachedBox(ParameterBox):
    """The cross-node box with ``[0, cached)`` cached in the node's shm box (see the module's docstring).

    >>> box = open_center_box(cfg, world, numel, counters, "center", cached=numel)  # doctest: +SKIP
    >>> box.push(update); box.pull(center)   # the node's box; every 2nd push of the node syncs it
    """

    backend = "rma"

    def __init__(self, cross: ParameterBox, node: ParameterBox, cached: int, pushers: int, origin: int = 1):
        super().__init__(cross.name, cross.numel, cross.num_counters, cross.timeout)
        self.cross, self.node, self.cached, self.pushers = cross, node, cached, max(1, pushers)
        self.origin = origin  # the node's name at the memory server (node rank + 1)
        self._local = threading.Lock()  # one sync of this process at a time (a background exchange's too)
        self._snap = torch.empty(cached)
        self._update = torch.empty(cached)
        self._global = torch.empty(cached)

    @property
    def syncs(self) -> int:
        """The node's syncs so far."""
        return self.node.read_counter(_SYNCS)

    # -- the cached range ---------------------------------------------------------------------------
    def _parts(self, start: int, n: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """``[start, start + n)`` split into its cached and its passed-through part (each (lo, hi) or None)."""
        end, cut = start + n, min(max(start, self.cached), start + n)
        return ((start, cut) if cut > start else None), ((cut, end) if end > cut else None)

    def _pull_into(self, out: torch.Tensor, start: int) -> Handle:
        cached, rest = self._parts(start, out.numel())
        handle: Handle = DONE
        if rest is not None:
            handle = self.cross.pull_async(out[rest[0] - start :], rest[0])
        if cached is not None:
            if self.node.read_counter(_SYNCS) == 0:
                self.sync(first=True)
            self.node.pull(out[: cached[1] - start], start)
        return handle

    def _push_from(self, src: torch.Tensor, scale: float, start: int) -> Handle:
        cached, rest = self._parts(start, src.numel())
        handle: Handle = DONE
        if rest is not None:
            handle = self.cross.push_async(src[rest[0] - start :], scale, rest[0])
        if cached is not None:
            self.node.push(src[: cached[1] - start], scale, start)
            if (self.node.add_counter(_PUSHES, 1) + 1) % self.pushers == 0:
                self.sync(wait=False)
        return handle

    def _write_from(self, src: torch.Tensor, start: int) -> None:
        self.cross.write(src, start)  # the nodes see it at their next sync (before their first pull)

    def sync(self, wait: bool = True, first: bool = False) -> bool:
        """Exchange the node's update for the global center (the module's docstring); False where
        ``wait=False`` found another sync under way (its update then waits for the next)."""
        with self._local if wait else _try(self._local) as mine, self.node.exclusive(wait=wait) as held:
            if not (mine and held) or (first and self.node.read_counter(_SYNCS) > 0):
                return bool(mine and held)
            while self._exchange():  # a sync cut short before this one: its update resent first
                pass
            return True

    def _exchange(self) -> bool:
        """One exchange, the node's lock held: the pending update of a sync cut short if there is one (True
        then), else the node's update now."""
        c = self.cached
        view = self.node.local_view()
        v, g, pending = view[:c], view[c : 2 * c], view[2 * c : 3 * c]
        resend = self.node.read_counter(_PENDING) > 0
        if resend:
            seq = self.node.read_counter(_SEQ)
            torch.add(g, pending, out=self._snap)  # its snapshot: S = G + U
        else:
            seq = self.node.add_counter(_SEQ, 1) + 1
            self._snap.copy_(v)
            torch.sub(self._snap, g, out=pending)  # U, in the node's box before it is marked pending
            self.node.add_counter(_PENDING, 1)
        self._update.copy_(pending)
        if getattr(self.cross, "once", False):
            self.cross.push_pull_once(self._update, self._global, self.origin, seq)
        else:
            self.cross.push_pull(self._update, self._global)
        self._snap.neg_().add_(self._global)  # G' - S
        self.node.push(self._snap)
        g.copy_(self._global)  # only the lock's holder writes G
        self.node.add_counter(_PENDING, -1)
        self.node.add_counter(_SYNCS, 1)
        return resend

    def sync_levels(self) -> None:
        self.sync()

    # -- everything else: the cross-node box ------------------------------------------------------
    def read_counter(self, i: int) -> int:
        return self.cross.read_counter(i)

    def add_counter(self, i: int, v: int) -> int:
        return self.cross.add_counter(i, v)

    def add_counter_async(self, i: int, v: int) -> Count:
        return self.cross.add_counter_async(i, v)

    def barrier(self, timeout: float | None = None) -> None:
        """The cross box's barrier, with a sync on each side: every push made before it is in every
        node's view after it, as on a box of one level."""
        self.sync()
        self.cross.barrier(timeout)
        self.sync()

    def failed_ranks(self) -> list[int]:
        return self.cross.failed_ranks()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.node.close()
            self.cross.close()

    def __getattr__(self, name: str) -> Any:  # the cross box's own facts (comm, shards, box_ranks, ...)
        if name in ("cross", "node"):
            raise AttributeError(name)
        return getattr(self.cross, name)


class _try:
    """``with _try(lock) as held``: the lock if free (held True), else nothing (held False)."""

    def __init__(self, lock: threading.Lock):
        self.lock, self.held = lock, False

    def __enter__(self) -> bool:
        self.held = self.lock.acquire(False)
        return self.held

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.lock.release()


_ADOPTED: dict[str, ParameterBox] = {}


def adopt_box(name: str, box: ParameterBox) -> None:
    """Hand an open box to the next ``adopted_box(name)`` in this process: a spare rank opened it
    with the others as it started, and the strategy it builds for the worker it replaces keeps it
    (opening it again would be a collective nobody else joins)."""
    _ADOPTED[name] = box


def adopted_box(name: str) -> ParameterBox | None:
    return _ADOPTED.pop(name, None)


def open_center_box(
    box: BoxConfig,
    world: World,
    numel: int,
    num_counters: int,
    name: str,
    *,
    cached: int,
    pushes: bool = True,
    layout_hash: int = 0,
    timeout: float = 60.0,
) -> ParameterBox:
    """The box of an asynchronous center: ``open_box``'s, with ``[0, cached)`` cached per node where
    two levels apply (``applies``) and ``cached`` > 0. ``pushes``: this rank pushes into the center (a
    memory rank does not); a node syncs once per as many of its pushes as it has such ranks.
    Collective over ``world``."""
    if not (cached and applies(box, world)):
        return open_box(box, world, numel, num_counters, name, layout_hash=layout_hash, timeout=timeout)
    node_world = World(world.local_rank, world.local_world_size, world.local_rank, world.local_world_size)
    node = open_box(
        "shm",
        node_world,
        3 * cached,
        5,
        f"{name}-node{world.node_rank}",
        layout_hash=layout_hash,
        timeout=timeout,
    )
    if pushes:
        node.add_counter(_PUSHERS, 1)
    node.barrier()
    cross = open_box(box, world, numel, num_counters, name, layout_hash=layout_hash, timeout=timeout)
    return NodeCachedBox(cross, node, cached, node.read_counter(_PUSHERS), origin=world.node_rank + 1)
