"""Inputs that used to get past every check or crash the loader: a canonical entry made by hand, JSON nested
thousands deep, headers of the wrong types, patterns that compile alone but not where PEFT puts them, archive
paths too deep or too long. Each is a refusal naming the problem, never a traceback or a stuck upload."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile

import pytest
import torch
from adapter_helpers import refused

from loraplex.adapters import AdapterLimits, ErrorCode, load_adapter
from loraplex.adapters.canonical import CanonicalAdapter, LoraWeights, content_hash

FILES = ("adapter_config.json", "adapter_model.safetensors")



def _canonical_file(path, adapter: CanonicalAdapter, change=None):
    """A canonical entry as a user could craft one: tensors changed, then a content hash that matches them."""
    from safetensors.torch import save_file

    tensors, meta = adapter.to_tensors()
    tensors = {k: v.clone() for k, v in tensors.items()}
    if change is not None:
        change(tensors)
    pairs = {}
    for key, t in tensors.items():
        _, layer, module, ab = key.split(".")
        pairs.setdefault((int(layer), module), {})[ab] = t
    if all(t.dtype == torch.float32 for t in tensors.values()) and pairs:
        meta["content_hash"] = content_hash({k: LoraWeights(p["lora_a"], p["lora_b"]) for k, p in pairs.items()})
    save_file(tensors, str(path), metadata=meta)
    return path


def test_a_canonical_entry_from_outside_the_store_is_checked_like_a_peft_adapter(llama_adapter_dir, llama_spec,
                                                                                 tmp_path):
    good = load_adapter(llama_adapter_dir, llama_spec)
    assert load_adapter(_canonical_file(tmp_path / "ok.safetensors", good), llama_spec) == good
    q_a, q_b = "layers.0.q_proj.lora_a", "layers.0.q_proj.lora_b"

    def nan(t):
        t[q_b][0, 0] = float("nan")

    refused(_canonical_file(tmp_path / "nan.safetensors", good, nan), llama_spec, ErrorCode.NON_FINITE,
             "layer 0 q_proj", "non-finite")

    def rank_96(t):
        t[q_a] = torch.randn(96, t[q_a].shape[1])
        t[q_b] = torch.randn(t[q_b].shape[0], 96)

    refused(_canonical_file(tmp_path / "rank.safetensors", good, rank_96), llama_spec, ErrorCode.RANK_TOO_LARGE,
             "96", "64")

    def mismatch(t):
        t[q_b] = t[q_b][:, :4].contiguous()

    refused(_canonical_file(tmp_path / "mis.safetensors", good, mismatch), llama_spec, ErrorCode.RANK_MISMATCH,
             "q_proj")

    def half(t):
        t[q_a] = t[q_a].half()

    refused(_canonical_file(tmp_path / "half.safetensors", good, half), llama_spec, ErrorCode.DTYPE_UNSUPPORTED,
             "fp32")

    def empty(t):
        t.clear()

    refused(_canonical_file(tmp_path / "empty.safetensors", good, empty), llama_spec, ErrorCode.STORE_CORRUPT,
             "no weights")


def test_json_nested_thousands_deep(adapter_copy, llama_spec):
    adapter_copy.config_path.write_text("[" * 100_000 + "]" * 100_000)
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, "nested too deeply")


def _safetensors_with_header(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_safetensors_headers_of_the_wrong_shape(adapter_copy, llama_spec):
    weights = adapter_copy.weights_path
    _safetensors_with_header(weights, b"[" * 50_000 + b"]" * 50_000)
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "nested too deeply")
    entry = {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}
    _safetensors_with_header(weights, json.dumps({"x": entry}).encode(), b"\0" * 4)
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "dtype that is not a string")


def test_archive_paths_too_deep_or_too_long(llama_adapter_dir, llama_spec, tmp_path):
    deep = tmp_path / "deep.zip"
    with zipfile.ZipFile(deep, "w") as zf:
        for name in FILES:
            zf.write(llama_adapter_dir / name, name)
        zf.writestr("a/" * 2100 + "f", b"x")
    refused(deep, llama_spec, ErrorCode.ARCHIVE_UNSAFE_PATH, "folders deep")
    assert not list(tmp_path.glob("**/a/a/a"))
    long = tmp_path / "long.zip"
    with zipfile.ZipFile(long, "w") as zf:
        for name in FILES:
            zf.write(llama_adapter_dir / name, "d" * 300 + "/" + name)
    refused(long, llama_spec, ErrorCode.ARCHIVE_UNSAFE_PATH, "longer than 255")


def test_a_duplicate_tar_member_is_named_without_the_scratch_folder(llama_adapter_dir, llama_spec, tmp_path):
    archive = tmp_path / "dup.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name in FILES:
            tf.add(llama_adapter_dir / name, name)
        info = tarfile.TarInfo("adapter_config.json")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"{}"))
    error = refused(archive, llama_spec, ErrorCode.ARCHIVE_UNSAFE_PATH, "'adapter_config.json' appears twice")
    assert "loraplex-adapter-" not in str(error) and "/tmp" not in str(error)


def test_a_failure_no_check_foresaw_is_still_a_refusal(adapter_copy, llama_spec, monkeypatch):
    """Whatever goes wrong inside, the caller gets an AdapterValidationError (an upload is marked failed),
    not an exception that leaves it validating for good."""
    import loraplex.adapters.loader as loader

    def broken(*args, **kwargs):
        raise KeyError("something unforeseen")

    monkeypatch.setattr(loader, "parse_lora_config", broken)
    refused(adapter_copy.path, llama_spec, ErrorCode.UNREADABLE, "KeyError", "something unforeseen")


def test_a_large_rank_limit_admits_a_large_adapter(tiny_llama_dir, llama_spec, tmp_path):
    from loraplex.testing import make_peft_adapter

    path = make_peft_adapter(tiny_llama_dir, tmp_path / "big", r=96, target_modules=["q_proj"])
    refused(path, llama_spec, ErrorCode.RANK_TOO_LARGE, "96")
    assert load_adapter(path, llama_spec, AdapterLimits(max_rank=128)).rank == 96


def test_weights_whose_update_overflows_are_refused(adapter_copy, llama_spec, llama_adapter_dir, tmp_path, q_keys):
    """Finite weights whose product B @ A overflows fp32 turn every output into inf and NaN: refused as
    non-finite, from a PEFT file and from a hand-made canonical entry alike."""
    q_a, q_b = q_keys
    tensors = adapter_copy.tensors()
    tensors[q_a][0, 0] = 1e30
    tensors[q_b][0, 0] = 1e30
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.NON_FINITE, "can overflow", "q_proj")

    good = load_adapter(llama_adapter_dir, llama_spec)

    def huge(t):
        t["layers.0.q_proj.lora_a"][0, 0] = 1e20
        t["layers.0.q_proj.lora_b"][0, 0] = 1e20

    refused(_canonical_file(tmp_path / "huge.safetensors", good, huge), llama_spec, ErrorCode.NON_FINITE,
            "can overflow")


@pytest.mark.parametrize("alpha", [1e30, 1e9])
def test_a_scaling_that_makes_the_update_overflow_is_refused(adapter_copy, llama_spec, alpha):
    """lora_alpha 1e30 (or a billion) over r 8: finite weights, but the model's output turns to noise and
    NaN; refused at upload, naming the module, instead of served."""
    adapter_copy.update_config(lora_alpha=alpha)
    refused(adapter_copy.path, llama_spec, ErrorCode.NON_FINITE, "can overflow")


def test_a_large_but_plausible_scaling_is_accepted(adapter_copy, llama_spec):
    adapter_copy.update_config(lora_alpha=1024, use_rslora=True)  # a scaling of 362 at r 8
    assert load_adapter(adapter_copy.path, llama_spec).rank == 8
