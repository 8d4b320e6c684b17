"""C++ extensions compiled on first use with the system compiler (torch's `load_inline`) and cached under
`~/.cache/torch_extensions` (or `TORCH_EXTENSIONS_DIR`); their functions run with Python's interpreter lock
released. When no compiler or headers exist, `load()` returns None once, with a warning, and the caller's
torch path serves.

Each build goes in a folder of its own per Python environment, torch version, processor and build tools
(`build_key`).
The code is compiled with `-march=native`, so a build made on one processor may use instructions another
lacks: under a home folder shared by machines of different kinds, a build found in one shared folder would
stop the process with an illegal instruction. And two environments (a checkout and an install) sharing one
folder would each rebuild the kernels, a minute or two, every time the other had run."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)


def processor_identity() -> str:
    """What `-march=native` compiles for: the processor's model and instruction-set flags, as the operating
    system reports them (Linux: /proc/cpuinfo), else the platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            keep = []
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("vendor_id", "cpu family", "model", "model name", "flags", "features",
                           "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "isa"):
                    keep.append(line.strip())
                elif not line.strip() and keep:  # the first processor's block is enough
                    break
            if keep:
                return "\n".join(keep)
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()} {platform.processor()}"


def build_tools() -> str:
    """The ninja and the compiler a build would run, as found on PATH now: a folder built by one ninja
    reads as out of date to another (each records its own command hashes), so two processes with different
    PATHs (a virtual environment's ninja, the system's) sharing a folder would rebuild it in turn."""
    compiler = os.environ.get("CXX", "c++")
    return f"{shutil.which('ninja')}\0{compiler}\0{shutil.which(compiler)}"


def build_key(extra: Sequence[str] = ()) -> str:
    """A short hash of what a cached build depends on beyond its source and flags: this Python
    environment, the torch it compiles against, the processor, and the build tools."""
    import torch

    parts = [sys.prefix, sys.version, torch.__version__, os.path.dirname(torch.__file__), processor_identity(),
             build_tools(), *extra]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


class InlineExtension:
    def __init__(self, name: str, source: str, functions: Sequence[str], *, what: str,
                 extra_cflags: Sequence[str] = ()):
        self.name = name  # bump its suffix when the C++ source changes incompatibly
        self.source = source
        self.functions = list(functions)
        self.what = what  # for the warning: "CPU LoRA kernel", ...
        self.extra_cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self._lock = threading.Lock()
        self._module = None
        self._failed = False

    def _bindings(self) -> str:
        """The module's Python bindings. Every function runs with the interpreter lock released (what
        torch's own operators do): a kernel holding it for tens of milliseconds would stall every other
        Python thread, the adapter loader and the server's event loop among them. The kernels touch
        only tensors, never Python objects."""
        defs = "".join(
            f'  m.def("{f}", &{f}, "{f}", pybind11::call_guard<pybind11::gil_scoped_release>());\n'
            for f in self.functions
        )
        return f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"

    def build_directory(self) -> str:
        """Where this extension is built and cached: torch's extension root (`TORCH_EXTENSIONS_DIR` where
        set), then a folder per environment, processor, flags and source (`build_key`): two checkouts or
        versions whose source differs under one name each keep their build, instead of rebuilding over each
        other at every start."""
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        source = hashlib.sha256((self.source + self._bindings()).encode()).hexdigest()
        return os.path.join(root, f"py{sys.version_info[0]}{sys.version_info[1]}_cpu",
                            f"{self.name}-{build_key([*self.extra_cflags, source])}")

    def load(self):
        """The compiled module, or None when it cannot be built (tried once per process). A build stopped by
        Ctrl-C raises KeyboardInterrupt rather than falling back to the torch path."""
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                try:
                    from torch.utils.cpp_extension import load_inline

                    directory = self.build_directory()
                    os.makedirs(directory, exist_ok=True)
                    with _exclusive_build(directory, self.what):
                        self._module = load_inline(
                            name=self.name, cpp_sources=[self.source + self._bindings()],
                            extra_cflags=self.extra_cflags, extra_ldflags=["-fopenmp"], verbose=False,
                            build_directory=directory,
                        )
                except Exception as exc:  # no compiler, no headers: the torch path still works
                    if "interrupted by user" in str(exc):  # Ctrl-C reached the compiler first
                        raise KeyboardInterrupt from exc
                    log.warning("%s unavailable, using the torch path: %s", self.what, exc)
                    self._failed = True
        return self._module


@contextlib.contextmanager
def _exclusive_build(directory: str, what: str):
    """Hold this build folder for one process at a time, with a lock the operating system drops when its
    holder exits however it exits. torch's own lock is a file that a process killed mid-build leaves behind,
    after which every later start would wait for it forever; holding ours, any such file is known stale
    and is removed."""
    try:
        import fcntl
    except ImportError:  # not a Unix: torch's lock alone
        yield
        return
    with open(os.path.join(directory, ".loraplex-build.lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building the %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                log.warning("removing %s, left by a build of the %s that was stopped", stale, what)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
