"""An adapter refused for its size whose adapter_config.json declares something refused anyway (modules_to_save,
trainable_token_indices, DoRA): the refusal names that reason, which a smaller file would meet too. PEFT's
modules_to_save=["lm_head"] on SmolLM2-135M makes a 116 MB weights file; here small limits stand in for it."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from adapter_helpers import refused

from loraplex.adapters import AdapterLimits, ErrorCode

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LIMITS = AdapterLimits(max_member_bytes=64 * 1024)
LARGE = b"\0" * (128 * 1024)  # over LIMITS' per-file limit, and cheap to compress

REFUSED_ANYWAY = [
    ({"modules_to_save": ["lm_head"]}, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save=['lm_head']"),
    ({"trainable_token_indices": [1, 2]}, ErrorCode.OPTION_UNSUPPORTED, "trainable_token_indices=[1, 2]"),
    ({"use_dora": True}, ErrorCode.DORA_UNSUPPORTED, "DoRA"),
]


def _config(adapter_dir: Path, **changes) -> bytes:
    config = json.loads((adapter_dir / CONFIG).read_text())
    config.update(changes)
    return json.dumps(config).encode()


def _zip(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("changes,code,words", REFUSED_ANYWAY)
@pytest.mark.parametrize("weights_first", [False, True])
def test_zip_over_the_per_file_limit_names_what_its_config_declares(llama_adapter_dir, llama_spec, tmp_path,
                                                                    changes, code, words, weights_first):
    members = [(CONFIG, _config(llama_adapter_dir, **changes)), (WEIGHTS, LARGE)]
    archive = _zip(tmp_path / "a.zip", members[::-1] if weights_first else members)
    error = refused(archive, llama_spec, code, words, limits=LIMITS)
    assert f"'{WEIGHTS}' is {len(LARGE)} bytes, over the per-file limit of 65536" in str(error), str(error)


@pytest.mark.parametrize("changes,code,words", REFUSED_ANYWAY)
def test_tar_over_the_per_file_limit_names_what_its_config_declares(llama_adapter_dir, llama_spec, tmp_path,
                                                                    changes, code, words):
    archive = _tar(tmp_path / "a.tar.gz", [(f"adapter/{CONFIG}", _config(llama_adapter_dir, **changes)),
                                           (f"adapter/{WEIGHTS}", LARGE)])
    error = refused(archive, llama_spec, code, words, limits=LIMITS)
    assert "over the per-file limit of 65536" in str(error), str(error)


def test_tar_is_not_read_past_the_refused_member_to_find_the_config(llama_adapter_dir, llama_spec, tmp_path):
    """A compressed tar cannot be skipped through: a config after the oversized member stays unread, and the
    refusal is the size's."""
    archive = _tar(tmp_path / "a.tar.gz", [(WEIGHTS, LARGE), (CONFIG, _config(llama_adapter_dir,
                                                                               modules_to_save=["lm_head"]))])
    refused(archive, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, "per-file limit", limits=LIMITS)


def test_zip_over_the_total_limit_names_what_its_config_declares(llama_adapter_dir, llama_spec, tmp_path):
    config = _config(llama_adapter_dir, modules_to_save=["lm_head"])
    archive = _zip(tmp_path / "a.zip", [(CONFIG, config), (WEIGHTS, LARGE), ("notes.txt", LARGE)])
    limits = AdapterLimits(max_total_bytes=len(config) + len(LARGE) + 1)
    error = refused(archive, llama_spec, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save",
                    "inflates past the limit", limits=limits)
    assert "'notes.txt'" in str(error), str(error)


def test_archive_over_its_own_size_limit_names_what_its_config_declares(llama_adapter_dir, llama_spec, tmp_path):
    archive = _zip(tmp_path / "a.zip", [(CONFIG, _config(llama_adapter_dir, modules_to_save=["lm_head"])),
                                        (WEIGHTS, LARGE)])
    refused(archive, llama_spec, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save",
            f"is {archive.stat().st_size} bytes, over the limit of 256",
            limits=AdapterLimits(max_archive_bytes=256))


def test_only_the_config_is_inflated(llama_adapter_dir, llama_spec, tmp_path, monkeypatch):
    archive = _zip(tmp_path / "a.zip", [(CONFIG, _config(llama_adapter_dir, modules_to_save=["lm_head"])),
                                        (WEIGHTS, LARGE)])
    opened = []
    real_open = zipfile.ZipFile.open

    def recording_open(self, name, *args, **kwargs):
        opened.append(name if isinstance(name, str) else name.filename)
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", recording_open)
    refused(archive, llama_spec, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, limits=LIMITS)
    assert opened == [CONFIG]


def test_an_accepted_config_leaves_the_size_refusal(llama_adapter_dir, llama_spec, tmp_path):
    for archive in (_zip(tmp_path / "a.zip", [(CONFIG, _config(llama_adapter_dir)), (WEIGHTS, LARGE)]),
                    _tar(tmp_path / "a.tar.gz", [(CONFIG, _config(llama_adapter_dir)), (WEIGHTS, LARGE)])):
        refused(archive, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, f"'{WEIGHTS}' is", limits=LIMITS)


@pytest.mark.parametrize("config", [b"{not json", b"{}" + b" " * (1024 * 1024)])
def test_a_config_unread_or_too_large_leaves_the_size_refusal(llama_spec, tmp_path, config):
    archive = _zip(tmp_path / "a.zip", [(CONFIG, config), (WEIGHTS, LARGE)])
    refused(archive, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, "per-file limit", limits=LIMITS)


def test_two_configs_leave_the_size_refusal(llama_adapter_dir, llama_spec, tmp_path):
    config = _config(llama_adapter_dir, modules_to_save=["lm_head"])
    archive = _zip(tmp_path / "a.zip", [(f"a/{CONFIG}", config), (f"b/{CONFIG}", config), (WEIGHTS, LARGE)])
    refused(archive, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, "per-file limit", limits=LIMITS)


def _oversized_weights(folder: Path, spec) -> None:
    """A weights file larger than any adapter of the model, without the disk space (a sparse file)."""
    with open(folder / WEIGHTS, "wb") as f:
        f.truncate(spec.max_adapter_bytes(64) + 32 * 1024 * 1024)


def test_folder_with_oversized_weights_names_what_its_config_declares(llama_adapter_dir, llama_spec, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / CONFIG).write_bytes(_config(llama_adapter_dir, modules_to_save=["lm_head"]))
    _oversized_weights(folder, llama_spec)
    for path in (folder, folder / CONFIG):
        refused(path, llama_spec, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save")
    refused(folder / WEIGHTS, llama_spec, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save",
            f"{WEIGHTS} is", "more than a LoRA adapter")
