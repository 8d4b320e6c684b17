"""An extension that cannot be built yields None once, with a warning, and is not retried."""

from __future__ import annotations

import logging

from loraplex.kernels.cpp_build import InlineExtension


def test_broken_source_gives_none_once(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("loraplex_test_broken_v1", "this is not C++ {", ["nothing"], what="test kernel")
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.cpp_build"):
        assert ext.load() is None
        assert ext.load() is None
    warnings = [r for r in caplog.records if "test kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_functions_release_the_interpreter_lock(tmp_path, monkeypatch):
    """Another Python thread keeps running while an extension function works (here: sleeps 300 ms)."""
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = "#include <torch/extension.h>\n#include <chrono>\n#include <thread>\n" \
             "int64_t nap(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); return ms; }\n"
    mod = InlineExtension("loraplex_test_nap_v1", source, ["nap"], what="test kernel").load()
    if mod is None:
        import pytest

        pytest.skip("no C++ compiler")
    counted = []
    started = threading.Event()
    stop = threading.Event()

    def count():
        started.set()
        n = 0
        while not stop.is_set():
            n += 1
        counted.append(n)

    worker = threading.Thread(target=count)
    worker.start()
    started.wait()
    before = threading.active_count()
    assert mod.nap(300) == 300
    stop.set()
    worker.join()
    assert before >= 2
    # Holding the lock, the call would leave the counter a few thousand steps at most (one 5 ms switch
    # interval before the call); released, the thread counts freely for the whole 300 ms.
    assert counted[0] > 1_000_000
