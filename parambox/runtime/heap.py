"""Freed memory kept in the process, so that each step's tensors do not fault in fresh pages (glibc).

Why: PyTorch allocates CPU tensors with ``malloc``. glibc hands a block back to the kernel when it is
freed if it was mapped on its own (above the mmap threshold) or if it leaves more free space at the
heap's top than the trim threshold; the thresholds adapt, but stay near the sizes seen so far. A
training step frees its activations and gradients and allocates them again in the next step, so
every step writes to fresh pages: a page fault and a page cleared for each 4 KiB. perf on a rank of
``bench cluster`` (bench CNN, one thread): 10-14 % of the main thread's CPU was page faults
(``exc_page_fault``, ``clear_page_erms``), most in oneDNN's reorders and in element-wise kernels.

``keep_freed_memory`` fixes both thresholds high (``mallopt``: blocks up to 32 MiB, glibc's largest,
come from the heap; the heap is trimmed only past 1 GiB free), so a freed block serves the next
step's allocation of its size. The process keeps the memory of its peak step mapped, as a caching
allocator does. Every parambox training rank and benchmark worker calls it; set
``PARAMBOX_KEEP_FREED_MEMORY=0`` to leave malloc as it was. It does nothing outside glibc (musl, macOS)
or under an allocator preloaded in malloc's place (jemalloc, tcmalloc: they ignore ``mallopt``).
"""

from __future__ import annotations

import ctypes
import os

ENV = "PARAMBOX_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2): larger values are refused
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Keep freed blocks in this process's heap for reuse; True where glibc took both settings."""
    if os.environ.get(ENV, "1") == "0" or not _running_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def _running_glibc() -> bool:
    """The C library this process runs on is glibc (asked of it, not read from the executable)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name here (musl, macOS)
        return False
