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
    """Another Python thread keeps running while an extension function works (here: sleeps 600 ms)."""
    import threading
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = "#include <torch/extension.h>\n#include <chrono>\n#include <thread>\n" \
             "int64_t nap(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); return ms; }\n"
    mod = InlineExtension("loraplex_test_nap_v1", source, ["nap"], what="test kernel").load()
    if mod is None:
        import pytest

        pytest.skip("no C++ compiler")
    stamps: list[float] = []
    started = threading.Event()
    stop = threading.Event()

    def count():
        started.set()
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.001)

    worker = threading.Thread(target=count)
    worker.start()
    started.wait()
    begun = time.monotonic()
    assert mod.nap(600) == 600
    ended = time.monotonic()
    stop.set()
    worker.join()
    # Holding the lock for its 600 ms, the call would leave the other thread no moment to run in its middle
    # (one switch interval, 5 ms, at most after it began); released, the thread runs all along, however
    # busy the machine is otherwise.
    middle = [t for t in stamps if begun + 0.15 < t < ended - 0.15]
    assert middle, f"the other thread never ran during the call ({len(stamps)} stamps in all)"


def test_builds_are_kept_apart_per_processor_and_environment(tmp_path, monkeypatch):
    """A build compiled with -march=native on one processor must never be loaded on another (a home folder
    shared by different machines), and two Python environments must not keep rebuilding over each other."""
    from loraplex.kernels import cpp_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("loraplex_test_where_v1", "", [], what="test kernel")
    here = ext.build_directory()
    assert here.startswith(str(tmp_path)) and "loraplex_test_where_v1-" in here
    assert ext.build_directory() == here  # stable: the cache is found again
    monkeypatch.setattr(cpp_build, "processor_identity", lambda: "vendor_id : AuthenticAMD\nflags : fpu sse2 avx2")
    other_cpu = ext.build_directory()
    monkeypatch.setattr(cpp_build, "processor_identity", lambda: "vendor_id : AuthenticAMD\nflags : fpu sse2 avx2 avx512f")
    avx512 = ext.build_directory()
    assert len({here, other_cpu, avx512}) == 3
    monkeypatch.setattr(cpp_build.sys, "prefix", "/somewhere/else/venv")
    assert ext.build_directory() != avx512
    flags = InlineExtension("loraplex_test_where_v1", "", [], what="test kernel", extra_cflags=["-mno-avx512f"])
    assert flags.build_directory() != ext.build_directory()
    # another source under the same name (two checkouts, or an edit without a new name) builds apart,
    # instead of each start rebuilding over the other's build
    edited = InlineExtension("loraplex_test_where_v1", "// edited\n", [], what="test kernel")
    assert edited.build_directory() != ext.build_directory()
    # another ninja on PATH (the virtual environment's, or the system's) reads the other's build as out of
    # date: each builds apart rather than both rebuilding one folder in turn
    before = ext.build_directory()
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: f"/other/bin/{name}")
    assert ext.build_directory() != before


def test_processor_identity_names_the_instruction_sets():
    import platform

    from loraplex.kernels.cpp_build import processor_identity

    ident = processor_identity()
    assert ident
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        assert "flags" in ident and "sse2" in ident


def test_a_build_lands_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("loraplex_test_folder_v1", "int64_t twice(int64_t v) { return 2 * v; }\n", ["twice"],
                          what="test kernel")
    mod = ext.load()
    if mod is None:
        import pytest

        pytest.skip("no C++ compiler")
    assert mod.twice(21) == 42
    built = list((tmp_path).rglob("loraplex_test_folder_v1*.so"))
    assert built and all(str(p).startswith(ext.build_directory()) for p in built)


def test_start_up_says_when_it_must_build_the_kernels(tmp_path, monkeypatch, caplog):
    """The engine's start-up warns that it is compiling only when this machine's build is not cached."""
    from loraplex.engine.llm_engine import prepare_cpu_kernels
    from loraplex.kernels import lora_cpu, ops_cpu

    if not (ops_cpu.available() and lora_cpu.available()):  # builds them into the usual cache if needed
        import pytest

        pytest.skip("no C++ compiler")
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.llm_engine"):
        prepare_cpu_kernels(lora=True)
    assert not [r for r in caplog.records if "building the CPU kernels" in r.getMessage()]
    caplog.clear()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: nothing built yet
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.llm_engine"):
        prepare_cpu_kernels(lora=True)  # the modules are already loaded in this process: nothing compiles
    assert [r for r in caplog.records if "building the CPU kernels" in r.getMessage()]


def test_a_lock_left_by_a_killed_build_does_not_block_later_starts(tmp_path, monkeypatch):
    """torch's build lock is a plain file; a process killed mid-build leaves it, and torch alone would wait
    for it forever. The load removes it (nothing else can be building: the folder's own lock says so)."""
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("loraplex_test_stale_v1", "int64_t one() { return 1; }\n", ["one"], what="test kernel")
    import os

    os.makedirs(ext.build_directory())
    open(os.path.join(ext.build_directory(), "lock"), "w").close()  # what a killed build leaves
    result = []
    worker = threading.Thread(target=lambda: result.append(ext.load()), daemon=True)
    worker.start()
    worker.join(timeout=900)  # a hang guard, not a speed check: the load is otherwise stuck for good
    assert not worker.is_alive(), "the load waited on the stale lock"
    if result[0] is None:
        import pytest

        pytest.skip("no C++ compiler")
    assert result[0].one() == 1
    assert not os.path.exists(os.path.join(ext.build_directory(), "lock"))


def test_ctrl_c_during_a_build_stops_the_process(monkeypatch, tmp_path):
    """Ctrl-C reaches the compiler too (same process group); torch reports that as a failed build, which must
    not be taken for 'no compiler' and served on the slow path."""
    import pytest
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def interrupted(**kwargs):
        raise RuntimeError("Error building extension 'x': [1/2] c++ ... ninja: build stopped: interrupted by user.")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", interrupted)
    ext = InlineExtension("loraplex_test_interrupted_v1", "", [], what="test kernel")
    with pytest.raises(KeyboardInterrupt):
        ext.load()
    assert not ext._failed  # a later call may still build it
