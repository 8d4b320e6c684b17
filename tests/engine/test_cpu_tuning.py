"""glibc malloc settings for CPU inference."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import torch
    from loraplex.engine.cpu_tuning import keep_freed_memory

    if not keep_freed_memory():
        print("untuned")
        sys.exit(0)

    def main_heap():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
        return 0, 0

    where = []

    def worker():
        # a few hundred KB, as the adapter loader's tensors: below the mmap threshold, so from an arena
        t = torch.empty(100_000)
        lo, hi = main_heap()
        where.append(lo <= t.data_ptr() < hi)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    print("main arena" if where[0] else "thread arena")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_worker_threads_allocate_from_the_main_arena():
    """A thread's own glibc arena unmaps its 64 MB heaps whenever they empty, whatever the trim threshold,
    so the adapter loader faulted every load's memory in again; after keep_freed_memory() a new thread
    allocates from the main arena, whose freed memory stays mapped."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
    if out == "untuned":
        pytest.skip("not glibc malloc")
    assert out == "main arena"
