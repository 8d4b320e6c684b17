"""Helpers shared by the adapter tests."""

from __future__ import annotations

import pytest

from loraplex.adapters import AdapterValidationError, load_adapter


def refused(path, spec, code, *words, limits=None) -> AdapterValidationError:
    """Loading `path` is refused with `code`, and the message names each of `words`."""
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(path, spec, limits)
    assert info.value.code == code, str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
    return info.value
