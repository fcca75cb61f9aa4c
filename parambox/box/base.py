"""The ``ParameterBox`` API every backend implements, and ``open_box``, the one way to get a box."""

from __future__ import annotations

import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from parambox.errors import CommTimeout, UserError
from parambox.runtime.world import World

BACKENDS = ("shm", "rma")
_OPTIONS = {"shm": {"stripe_bytes"}, "rma": {"num_shards", "box_ranks", "memory_ranks", "server", "comm"}}
_LEVEL_OPTIONS = {
    "rma": {"two_level", "spare_ranks"}
}  # how strategies use the backend, not open_box's options


class BoxConfig(BaseModel):
    """The run's box: ``[box]`` in TOML, ``--set box.num_shards=2``, ``--box rma`` (the backend alone).

    >>> BoxConfig(backend="rma", num_shards=2).options()
    {'num_shards': 2}
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: Literal["shm", "rma"] = "shm"
    stripe_bytes: int | None = Field(
        None, ge=4, description="shm: bytes per push lock stripe (default 4 MiB)"
    )
    num_shards: int | None = Field(
        None, ge=1, description="rma: shards of the buffer, spread over the ranks (default: one per rank)"
    )
    box_ranks: list[int] | None = Field(
        None, description="rma: the ranks that hold the shards, one shard each (overrides num_shards)"
    )
    memory_ranks: int | None = Field(
        None,
        ge=0,
        description=(
            "rma: the last K ranks hold the box (one shard each) and do no training, so that a dead "
            "worker takes no part of the box with it (default: 1 for asynchronous strategies, else 0)"
        ),
    )

    spare_ranks: int | None = Field(
        None,
        ge=0,
        description=(
            "rma, asynchronous strategies: K more ranks of the MPI job that train nothing until a worker "
            "dies, then one of them takes its place (its rank, data and steps, from the center), as a "
            "replacement does under the local launcher; placed after the workers, before the memory "
            "ranks, which they need (default 0)"
        ),
    )

    server: bool | None = Field(
        None,
        description=(
            "rma: the box ranks apply pushes themselves over two-sided messages, so a pushed or pulled "
            "byte crosses the link once (default: across nodes; within one node MPI's windows)"
        ),
    )

    two_level: bool | None = Field(
        None,
        description=(
            "rma, across nodes with several workers a node: the node's workers exchange through its shm "
            "box and one exchange per node crosses the link (box-sync's mean; the asynchronous center, "
            "cached per node) (default: on)"
        ),
    )

    @model_validator(mode="after")
    def _options_of_its_backend(self) -> BoxConfig:
        for field in (
            "stripe_bytes",
            "num_shards",
            "box_ranks",
            "memory_ranks",
            "spare_ranks",
            "server",
            "two_level",
        ):
            if getattr(self, field) is not None and field not in _OPTIONS[self.backend] | _LEVEL_OPTIONS.get(
                self.backend, set()
            ):
                raise ValueError(f"box.{field} is not an option of the {self.backend} backend")
        if self.memory_ranks and (self.box_ranks is not None or self.num_shards is not None):
            raise ValueError(
                "box.memory_ranks places the shards itself: drop box.box_ranks and box.num_shards"
            )
        if self.spare_ranks and self.memory_ranks == 0:
            raise ValueError(
                "box.spare_ranks needs box.memory_ranks >= 1: a worker that holds part of the box "
                "takes it with it, and no spare can bring it back"
            )
        return self

    def needs_process_group(self, world: World) -> bool:
        """The shm box under torchrun/srun agrees on its segment names through torch.distributed's store."""
        import os

        from parambox.runtime.spawn import PREFIX_ENV

        return self.backend == "shm" and world.local_world_size > 1 and not os.environ.get(PREFIX_ENV)

    def options(self) -> dict[str, Any]:
        """The backend options that are set, as ``open_box`` takes them."""
        exclude = {"backend", "two_level", "spare_ranks"}
        return {k: v for k, v in self.model_dump(exclude=exclude).items() if v is not None}

    @property
    def needs_mpi(self) -> bool:
        """The box lives in MPI windows: the local launcher starts the workers under mpiexec."""
        return self.backend == "rma"

    @property
    def has_local_view(self) -> bool:
        """Boxes of this backend give each process the buffer itself (``ParameterBox.local_view``)."""
        return self.backend == "shm"


# wait_until's polling: spin (yielding the core) this long, then naps from the first, doubling to the last;
# past that, a long wait (a slow link's transfer) naps LONG_WAIT_SHARE of the time waited so far, up to
# LONG_NAP_S: at most that share late, with a few hundred looks instead of thousands.
SPIN_S, FIRST_NAP_S, NAP_S = 5e-5, 5e-5, 4e-4
LONG_WAIT_SHARE, LONG_NAP_S = 1 / 64, 4e-3
VERSION_COUNTER = 0  # counter 0: the box's version (bumped by whoever publishes a new state)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def step_counter(rank: int) -> int:
    """The counter that holds worker ``rank``'s step count (counters 1..world_size)."""
    return 1 + rank


def default_num_counters(world_size: int) -> int:
    """The version counter plus one step counter per worker."""
    return 1 + world_size


class Handle:
    """What ``pull_async``/``push_async`` return; ``wait()`` blocks until the transfer is complete,
    ``test()`` says whether it is (completing it where it can without waiting)."""

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        self.wait()
        return True


def wait_all(handles: Sequence[Handle], timeout: float, what: str) -> None:
    """``wait()`` on every handle, polling them together: one spin and one ladder of naps for all
    (box-sync's step waits on ten gated pulls; one by one each began its own). A look tests them in
    order up to the first not done: they mostly complete in the order they were asked, one test
    drives every transfer of the process, and a look at all of them cost O(handles) a nap (a hundred
    buckets of the 25M-parameter model)."""
    pending = list(reversed(handles))

    def done() -> bool:
        while pending and pending[-1].test():
            pending.pop()
        return not pending

    wait_until(done, timeout, lambda: f"{what}: {len(pending)} transfer(s) not done within {timeout:.0f} s")


DONE = Handle()  # backends that finish the transfer inside the call return this


class Count(Handle):
    """A counter add in flight (``add_counter_async``): ``wait()`` returns the value before the add."""

    def __init__(self, value: int = 0):
        self.value = value

    def wait(self) -> int:
        return self.value


class _StagedPull(Handle):
    """A pull into a host staging buffer, copied into the caller's tensor (GPU, other dtype) on wait."""

    def __init__(self, inner: Handle, stage: torch.Tensor, out: torch.Tensor):
        self.inner, self.stage, self.out = inner, stage, out

    def wait(self) -> None:
        if self.stage is not None:
            self.inner.wait()
            self.out.copy_(self.stage.view_as(self.out))
            self.stage = None


# Decoding of encoded pushes (``ParameterBox.push_encoded_async``): ``decode(code, message, numel, params)``
# gives the float32 values of a uint8 ``message``. The layer that owns the encodings sets it
# (``strategies/compress.py``, on import): the box carries codes and adds float32, and knows no encoding.
Decoder = Callable[[int, torch.Tensor, int, tuple[float, ...]], torch.Tensor]
_decoder: list[Decoder] = []


def set_decoder(decode: Decoder) -> None:
    """The decoder of encoded pushes, for every box of this process (set once, on import of the encodings)."""
    _decoder[:] = [decode]


def decode_push(code: int, message: torch.Tensor, numel: int, params: tuple[float, ...]) -> torch.Tensor:
    """The float32 values of an encoded push (``set_decoder``'s decoder)."""
    assert _decoder, "no decoder of encoded pushes set (import parambox.strategies.compress)"
    return _decoder[0](code, message, numel, params)


class ParameterBox(ABC):
    """A flat float32 buffer shared by a run's processes: read, write, accumulate, plus int64 counters.

    ``start`` selects a sub-range ``[start, start + n)`` of the buffer for every transfer, so a
    strategy can work on shards. ``push`` is atomic per element with respect to other pushers;
    ``pull`` takes no lock (it may see another worker's push half applied, as asynchronous SGD
    allows). Host float32 tensors are used in place; others (GPU, float64) are staged through the host.

    >>> box = open_box("shm", World(), numel=4, num_counters=1, name="demo")  # doctest: +SKIP
    >>> box.push(torch.ones(4), scale=0.5); box.pull(torch.empty(4))  # doctest: +SKIP
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    >>> box.add_counter(0, 1), box.read_counter(0)  # doctest: +SKIP
    (0, 1)
    """

    backend: ClassVar[str]
    # True where the buffer stays readable after a process of the box exits (shm: shared memory);
    # False where each rank hosts a shard of it (rma), so a rank must stay until the others are done.
    outlives_processes: ClassVar[bool] = False
    # True where the box's own servers apply asynchronous DiLoCo's outer step (``outer_step_async``,
    # ``pull_companion``, ``write_companion``: the rma box's memory server); elsewhere the strategy
    # runs it with pulls, writes and pushes.
    fuses_outer_step: ClassVar[bool] = False

    def __init__(self, name: str, numel: int, num_counters: int, timeout: float):
        self.name, self.numel, self.num_counters, self.timeout = name, numel, num_counters, timeout
        self._closed = False

    # -- transfers ---------------------------------------------------------------------------------
    def pull(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``out[:] = box[start:start + out.numel()]``; returns ``out``."""
        self.pull_async(out, start).wait()
        return out

    def push(self, delta: torch.Tensor, scale: float = 1.0, start: int = 0) -> None:
        """``box[start:start + n] += scale * delta``, atomic per element with respect to other pushers."""
        self.push_async(delta, scale, start).wait()

    def pull_async(self, out: torch.Tensor, start: int = 0) -> Handle:
        """Start a pull; ``out`` holds the values once the handle's ``wait()`` returns."""
        self._span(out.numel(), start)
        if _is_host_flat(out):
            return self._pull_into(out.view(-1), start)
        stage = torch.empty(out.numel(), dtype=torch.float32)
        return _StagedPull(self._pull_into(stage, start), stage, out)

    def push_async(self, delta: torch.Tensor, scale: float = 1.0, start: int = 0) -> Handle:
        """Start a push; ``delta`` must stay unchanged until the handle's ``wait()`` returns."""
        src = _host_flat(delta)
        self._span(src.numel(), start)
        return self._push_from(src, float(scale), start)

    def push_pull(
        self, delta: torch.Tensor, out: torch.Tensor, scale: float = 1.0, start: int = 0
    ) -> torch.Tensor:
        """``push(delta, scale, start)``, then ``pull(out, start)``: ``out`` holds the values this push
        left (and whatever others pushed meanwhile); returns ``out``."""
        self.push_pull_async(delta, out, scale, start).wait()
        return out

    def push_pull_async(
        self, delta: torch.Tensor, out: torch.Tensor, scale: float = 1.0, start: int = 0
    ) -> Handle:
        """Start a ``push_pull``. On the memory server (``box/server.py``) it is one request: each
        applied piece comes back at once, so the push and the pull use the link's two directions
        together; elsewhere a push, then a pull."""
        src = _host_flat(delta)
        self._span(src.numel(), start)
        if out.numel() != src.numel():
            raise ValueError(f"box {self.name!r}: push_pull of {src.numel()} values into {out.numel()}")
        if _is_host_flat(out):
            return self._push_pull(src, out.view(-1), float(scale), start)
        stage = torch.empty(out.numel(), dtype=torch.float32)
        return _StagedPull(self._push_pull(src, stage, float(scale), start), stage, out)

    # True where ``elastic_async`` is one request that moves the center under its lock (the rma memory
    # server); elsewhere it is a pull, then a push.
    fuses_elastic: ClassVar[bool] = False

    def elastic_async(self, x: torch.Tensor, out: torch.Tensor, alpha: float, start: int = 0) -> Handle:
        """EASGD's exchange with the values ``c`` at ``[start, start + x.numel())``: ``out = x - c``
        and ``c += alpha out``, ``c`` as it was when read. On the memory server (``fuses_elastic``) one
        request whose answer flows back while ``x`` still flows out, each chunk read and moved under
        its shard's lock; elsewhere a pull, then a push (a push of another process may land between)."""
        src = _host_flat(x)
        self._span(src.numel(), start)
        if out.numel() != src.numel():
            raise ValueError(
                f"box {self.name!r}: elastic exchange of {src.numel()} values into {out.numel()}"
            )
        if _is_host_flat(out):
            return self._elastic(src, out.view(-1), float(alpha), start)
        stage = torch.empty(out.numel(), dtype=torch.float32)
        return _StagedPull(self._elastic(src, stage, float(alpha), start), stage, out)

    def _elastic(self, x: torch.Tensor, out: torch.Tensor, alpha: float, start: int) -> Handle:
        """A backend that applies the exchange where the values live overrides this."""
        self._pull_into(out, start).wait()
        torch.sub(x, out, out=out)
        return self._push_from(out, alpha, start)

    # -- encoded pushes ----------------------------------------------------------------------------
    # True where the box's own servers decode an encoded push (the rma memory server): the codes cross
    # the link; elsewhere the pushing process decodes it and the box moves float32.
    decodes_pushes: ClassVar[bool] = False

    def code_pieces(self, start: int, n: int) -> list[tuple[int, int]]:
        """The ranges of ``[start, start + n)`` each encoded on its own for ``push_encoded_async`` (one
        a shard where the shards' servers decode them; the whole range elsewhere)."""
        return [(start, start + n)]

    def push_encoded_async(
        self,
        messages: Sequence[torch.Tensor],
        n: int,
        code: int,
        params: tuple[float, ...],
        scale: float = 1.0,
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> Handle:
        """``box[start:start + n] += scale * decode(messages)``, one uint8 message per range of
        ``code_pieces(start, n)`` (``code``, ``params``: the encoding, for ``decode_push``); with
        ``out``, then ``out <- box[start:start + n]`` as ``push_pull``. Here the caller's process decodes
        and the push moves float32 (done when it returns); the memory server takes the codes."""
        pieces = self.code_pieces(start, n)
        assert len(messages) == len(pieces), "one message per code piece"
        values = torch.cat([decode_push(code, m, hi - lo, params) for m, (lo, hi) in zip(messages, pieces)])
        if out is None:
            self.push(values, scale, start)
        else:
            self.push_pull(values, out, scale, start)
        return DONE

    def write(self, src: torch.Tensor, start: int = 0) -> None:
        """``box[start:start + n] = src`` (atomic per element with respect to pushers)."""
        flat = _host_flat(src)
        self._span(flat.numel(), start)
        self._write_from(flat, start)

    # -- counters ----------------------------------------------------------------------------------
    @abstractmethod
    def read_counter(self, i: int) -> int:
        """The current value of counter ``i``."""

    @abstractmethod
    def add_counter(self, i: int, v: int) -> int:
        """Atomically add ``v`` to counter ``i``; returns the value before the add."""

    def add_counter_async(self, i: int, v: int) -> Count:
        """Start ``add_counter(i, v)``; the handle's ``wait()`` returns the value before the add. Where
        the counters are remote (``rma`` across nodes) the add travels while the caller goes on, so
        several adds cost one round trip; elsewhere it is done in the call."""
        return Count(self.add_counter(i, v))

    def set_counter(self, i: int, value: int) -> None:
        """Counter ``i`` := ``value``, for a counter one process writes at a time (a read, then an add)."""
        self.add_counter(i, value - self.read_counter(i))

    # -- collective helpers ------------------------------------------------------------------------
    @abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every process of the box arrives; ``CommTimeout`` naming the box otherwise."""

    @abstractmethod
    def close(self) -> None:
        """Release the box (idempotent). For ``rma`` it is collective; tensors from ``tensor()`` stay valid."""

    def tensor(self) -> torch.Tensor:
        """The shared buffer itself as a flat float32 tensor (``shm`` only): writes bypass the locks."""
        view = self.local_view()
        if view is None:
            raise UserError(f"the {self.backend} box has no process-local tensor; use pull/push/write")
        return view

    def sync_levels(self) -> None:
        """Where this process sees the box through a cache of its node's (``box/node_cache.py``): send
        the node's updates and take the box's current values now. Nothing to do elsewhere."""
        return None

    def failed_ranks(self) -> list[int]:
        """Ranks of the box that MPI knows dead (``rma`` under ``--with-ft ulfm``); empty elsewhere."""
        return []

    def local_view(self) -> torch.Tensor | None:
        """The buffer itself, mapped in this process (``shm``), or None where it is remote (``rma``).

        A strategy reads it in place where there is one (no pull copy) and falls back to ``pull``.
        """
        return None

    # -- backend hooks -----------------------------------------------------------------------------
    @abstractmethod
    def _pull_into(self, out: torch.Tensor, start: int) -> Handle: ...

    @abstractmethod
    def _push_from(self, src: torch.Tensor, scale: float, start: int) -> Handle: ...

    @abstractmethod
    def _write_from(self, src: torch.Tensor, start: int) -> None: ...

    def _push_pull(self, src: torch.Tensor, out: torch.Tensor, scale: float, start: int) -> Handle:
        """A backend that can answer a push with the values it left overrides this."""
        self._push_from(src, scale, start).wait()
        return self._pull_into(out, start)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"box {self.name!r} is closed")

    def _span(self, n: int, start: int) -> tuple[int, int]:
        self._check_open()
        if start < 0 or start + n > self.numel:
            raise ValueError(f"box {self.name!r}: range [{start}, {start + n}) is outside [0, {self.numel})")
        return start, start + n

    def _counter_index(self, i: int) -> int:
        self._check_open()
        if not 0 <= i < self.num_counters:
            raise ValueError(f"box {self.name!r}: counter {i} is outside [0, {self.num_counters})")
        return i

    def __enter__(self) -> ParameterBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, numel={self.numel}, num_counters={self.num_counters})"
        )


def _is_host_flat(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _host_flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not _is_host_flat(t):
        t = t.to("cpu", torch.float32).contiguous()
    return t.view(-1)


def wait_until(ready: Callable[[], Any], timeout: float, what: Callable[[], str]) -> Any:
    """Poll ``ready()`` until it returns something truthy; ``CommTimeout(what())`` after ``timeout`` s.

    Spins for up to ``SPIN_S`` (a box barrier is often met within microseconds), yielding the core
    between looks, then naps, each nap twice the last, up to ``NAP_S``: a waiting process leaves the
    CPU to the ones it waits for. Every nap is a timed sleep, and every look (an MPI request's test
    drives its transfers) costs CPU: 17-32 us a sleep on the VMs measured here, about 30 us a look
    and nap over the rma box's TCP, so a 0.54 s pull at 0.4 ms naps took about 44 ms of CPU a step
    from the training on the same cores (bench cluster, 4 nodes at 0.1 Gbit/s). Past ``NAP_S`` a nap
    is ``LONG_WAIT_SHARE`` of the time waited so far (up to ``LONG_NAP_S``): the answer is seen at
    most that share late.
    """
    start = time.monotonic()
    deadline = start + timeout
    spin_until = time.perf_counter() + SPIN_S
    pause = FIRST_NAP_S
    while True:
        value = ready()
        if value:
            return value
        if time.perf_counter() < spin_until:
            os.sched_yield()
            continue
        now = time.monotonic()
        if now > deadline:
            raise CommTimeout(what())
        time.sleep(pause)
        pause = grown_nap(pause, now - start, NAP_S, LONG_WAIT_SHARE, LONG_NAP_S)


def grown_nap(pause: float, waited: float, short: float, share: float, longest: float) -> float:
    """The nap after one of ``pause`` in a wait of ``waited`` so far: twice the last, up to ``short``;
    past that ``share`` of the wait, up to ``longest`` (what waits, here and the memory server, nap).

    >>> grown_nap(1e-4, 0.0, 4e-4, 1 / 64, 4e-3), grown_nap(4e-4, 0.128, 4e-4, 1 / 64, 4e-3)
    (0.0002, 0.0008)
    """
    return min(2 * pause, max(short, min(longest, waited * share)))


def open_box(
    backend: str | BoxConfig,
    world: World,
    numel: int,
    num_counters: int | None = None,
    name: str = "params",
    *,
    layout_hash: int = 0,
    timeout: float = 60.0,
    **options: Any,
) -> ParameterBox:
    """Create or attach the box ``name`` (collective over the box's processes: call it on every rank).

    ``num_counters`` defaults to ``1 + world.world_size`` (counter 0 the version, ``1 + rank`` each
    worker's steps). ``layout_hash`` (``Layout.fingerprint()``) makes attaching with another model
    an error. Backend options: shm ``stripe_bytes``; rma ``num_shards``, ``box_ranks``, ``memory_ranks``,
    ``server``, ``comm``.
    ``backend`` is a backend name or the run's :class:`BoxConfig` (its options, then ``options``).
    """
    if isinstance(backend, BoxConfig):
        backend, options = backend.backend, {**backend.options(), **options}
    if backend not in BACKENDS:
        raise UserError(f"box backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if not _NAME.fullmatch(name):
        raise UserError(f"box name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    if numel < 1:
        raise UserError(f"box {name!r}: numel must be positive, got {numel}")
    unknown = sorted(set(options) - _OPTIONS[backend])
    if unknown:
        raise UserError(f"box {name!r}: the {backend} backend has no option {unknown[0]!r}")
    num_counters = default_num_counters(world.world_size) if num_counters is None else num_counters
    if num_counters < 0:
        raise UserError(f"box {name!r}: num_counters must be >= 0, got {num_counters}")
    if backend == "shm":
        from parambox.box.shm import open_shm_box

        return open_shm_box(
            world, numel, num_counters, name, layout_hash=layout_hash, timeout=timeout, **options
        )
    from parambox.runtime.mpi import srun_without_mpi

    reason = srun_without_mpi()
    if reason:  # before mpi4py is imported: a singleton would leave its files in /dev/shm
        raise UserError(reason)
    from parambox.box.rma import open_rma_box

    return open_rma_box(world, numel, num_counters, name, layout_hash=layout_hash, timeout=timeout, **options)
