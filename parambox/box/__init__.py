"""The box: a flat float32 parameter buffer that every worker can read, write and accumulate into.

``open_box(backend, world, numel, num_counters, name)`` is collective: every process of the box
calls it with the same arguments (``backend``: a name, or the run's typed :class:`BoxConfig`, the
``[box]`` table of a run config) and gets a :class:`ParameterBox` with ``pull``/``push``/``write``
(and ``_async`` forms returning a handle to ``wait()`` on), small atomic int64 counters
(``VERSION_COUNTER`` = 0, then ``step_counter(rank)`` = ``1 + rank`` per worker), ``barrier`` and
``close``. :class:`Layout` maps a model's parameters to offsets in the buffer (views, no copies).

Backends
--------
``shm``
    One node. A POSIX shared-memory segment ``/dev/shm/<run prefix><name>``, mode 0600, created by
    local rank 0 and mapped by the other local processes. ``box.tensor()`` is the shared buffer
    itself: Hogwild binds the model's parameters into it with ``Layout.bind_params_``. Pushes take
    striped ``fcntl`` byte-range locks, so they run at memory speed and a dead process never holds
    a lock. A pull takes no lock.
``rma``
    Any number of nodes, under mpiexec or srun. MPI-3 windows through mpi4py, passive target
    (``Accumulate``/``Get``/``Fetch_and_op`` + ``Flush``). The box ranks are the workers
    themselves: shard ``k`` of ``num_shards`` (default: one per rank) lives on rank
    ``k * size // num_shards`` (or ``box_ranks[k]``), the counters on the first box rank
    (``--set box.num_shards=2``, ``--set box.box_ranks=[0]``). Across nodes (``box.server``, the
    default where the run spans nodes) the box ranks serve requests instead of exposing windows: a
    thread of each applies pushes itself over two-sided messages, so each pushed or pulled byte
    crosses the link once (Open MPI's accumulate over TCP moved 3.26x; ``bench box --emulate-nodes``).

Clean-up guarantees (shm)
-------------------------
Segment names carry a random per-run prefix (``PARAMBOX_SHM_PREFIX``, set by the local launcher).
Under torchrun, srun or mpiexec a name exists only while ``open_box`` runs: once every local process
has the segment mapped, it is unlinked, so a run that is SIGKILLed or interrupted later leaves nothing
in /dev/shm; the memory goes when the last process unmaps it. Under parambox's launcher the name stays
while the run lasts (a replacement of a dead worker attaches by it), and the launcher removes the
run's segments when it ends, or its reaper when the launcher itself is SIGKILLed. A failed or timed-out open unlinks the name too, and the
launcher calls :func:`remove_segments` with the run's prefix at the end as a backstop for a process
killed inside ``open_box``. For ``rma``, MPI owns the window memory and frees it with the job.
"""

from parambox.box.base import (
    BACKENDS,
    VERSION_COUNTER,
    BoxConfig,
    Handle,
    ParameterBox,
    default_num_counters,
    open_box,
    step_counter,
)
from parambox.box.layout import Layout, shard_of, shard_range
from parambox.box.shm import PREFIX_ENV, new_prefix, remove_segments

__all__ = [
    "BACKENDS",
    "BoxConfig",
    "PREFIX_ENV",
    "VERSION_COUNTER",
    "Handle",
    "Layout",
    "ParameterBox",
    "default_num_counters",
    "new_prefix",
    "open_box",
    "remove_segments",
    "shard_of",
    "shard_range",
    "step_counter",
]
