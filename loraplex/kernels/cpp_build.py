"""C++ extensions compiled on first use with the system compiler (torch's `load_inline`) and cached under
`~/.cache/torch_extensions`; their functions run with Python's interpreter lock released. When no compiler
or headers exist, `load()` returns None once, with a warning, and the caller's torch path serves."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)


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

    def load(self):
        """The compiled module, or None when it cannot be built (tried once per process)."""
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                try:
                    from torch.utils.cpp_extension import load_inline

                    self._module = load_inline(
                        name=self.name, cpp_sources=[self.source + self._bindings()],
                        extra_cflags=self.extra_cflags, extra_ldflags=["-fopenmp"], verbose=False,
                    )
                except Exception as exc:  # no compiler, no headers: the torch path still works
                    log.warning("%s unavailable, using the torch path: %s", self.what, exc)
                    self._failed = True
        return self._module
