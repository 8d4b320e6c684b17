"""A file named like an archive whose bytes are not one says so, instead of claiming an unknown format."""

import pytest

from loraplex.adapters.errors import AdapterValidationError, ErrorCode
from loraplex.adapters.loader import load_adapter


@pytest.mark.parametrize("name", ["adapter.zip", "adapter.tar.gz", "ADAPTER.TGZ", "adapter.tar"])
def test_archive_name_with_other_content_is_a_corrupt_archive(llama_spec, tmp_path, name):
    path = tmp_path / name
    path.write_text("this is not an archive\n")
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(path, llama_spec)
    assert info.value.code == ErrorCode.ARCHIVE_CORRUPT
    assert name in str(info.value) and "not a zip or tar archive" in str(info.value)


def test_other_names_are_still_an_unsupported_format(llama_spec, tmp_path):
    path = tmp_path / "adapter.json"
    path.write_text("{}")
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(path, llama_spec)
    assert info.value.code == ErrorCode.UNSUPPORTED_FORMAT
