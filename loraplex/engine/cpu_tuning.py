"""Process settings that matter for CPU inference.

glibc serves large allocations (activations of a prefill step are megabytes) with fresh mmap'd pages and
returns them at free, so every step page-faults its activations in again: measured at ~160k minor faults
for one 1.5k-token prefill step of a 135M model. Keeping freed memory in the heap makes later steps reuse
warm pages. The heap then stays at its high-water mark, which a long-lived engine process reaches anyway.

The same goes for threads other than the first: glibc gives each its own arena, made of 64 MB heaps that
are unmapped as soon as they are entirely free, whatever the trim threshold. The adapter loader allocates
and frees tens of MB per adapter, so its heaps came and went, and every load faulted its memory in again
(6.5k faults and 130 ms of kernel time per load beside a running step, against 15 ms for the whole load
in one arena). All threads share the main arena instead; the engine's threads allocate rarely enough
that they do not queue on its lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
_done = False


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory for reuse. Returns whether the settings took effect."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
        ok = libc.mallopt(_M_ARENA_MAX, 1) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, another allocator preloaded)
        return False
    _done = ok
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
