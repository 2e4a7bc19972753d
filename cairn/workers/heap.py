"""The process heap, tuned for an engine on CPU: `retain_freed_memory()`.

A CPU step allocates its activations afresh (torch's CPU allocator caches nothing), megabytes a
tensor. glibc serves a block that large with a fresh `mmap` and unmaps it when freed, so every
step faults in every page of every activation again: about a third of the delta rule's time at a
4,096-token segment (490 -> 360 ns a token measured), and a few percent of a prefill. Told to keep
freed memory, glibc serves blocks of up to 32 MiB (its largest threshold) from its heaps, and
returns nothing to the system below 1 GiB free at the top: a step reuses the pages the last one
faulted in.

Contract: `retain_freed_memory()` sets that once per process (glibc's `mallopt`) and returns
whether it could; on another C library it does nothing and returns False. The process keeps its
high-water mark of activations, which an engine holds again at its next long prefill anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest: 4 MiB * sizeof(long)
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def retain_freed_memory() -> bool:
    global _done
    if _done is None:
        _done = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if not _done:
            log.warning("glibc refused the heap settings; activations are mapped afresh every step")
    return _done
