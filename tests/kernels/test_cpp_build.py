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
