"""LocalAdapterStore: immutable entries named by content hash, atomic writes, fast loads."""

from __future__ import annotations

import pickle
import statistics
import time

import pytest
import torch

from loraplex.adapters import (
    MODULES,
    AdapterStore,
    AdapterValidationError,
    BaseModelSpec,
    CanonicalAdapter,
    ErrorCode,
    LocalAdapterStore,
    LoraWeights,
    content_hash,
    load_adapter,
)

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


def _synthetic(spec: BaseModelSpec, rank: int, seed: int = 0) -> CanonicalAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for module in MODULES:
            shape = spec.modules[module]
            weights[(layer, module)] = LoraWeights(torch.randn(rank, shape.in_features, generator=g),
                                                   torch.randn(shape.out_features, rank, generator=g))
    return CanonicalAdapter.build(weights, architecture=spec.architecture, num_layers=spec.num_layers)


def test_round_trip(llama_adapter_dir, llama_spec, tmp_path):
    adapter = load_adapter(llama_adapter_dir, llama_spec)
    store = LocalAdapterStore(tmp_path / "store")
    assert isinstance(store, AdapterStore)
    assert not store.exists(adapter.content_hash) and store.list() == []
    path = store.put(adapter)
    assert path.endswith(f"{adapter.content_hash}.safetensors")
    assert store.exists(adapter.content_hash) and store.list() == [adapter.content_hash]
    loaded = store.get(adapter.content_hash, verify=True)
    assert loaded == adapter and loaded.architecture == "LlamaForCausalLM" and loaded.num_layers == 2
    for key, w in adapter.weights.items():
        assert torch.equal(loaded.weights[key].a, w.a) and torch.equal(loaded.weights[key].b, w.b)
        assert loaded.weights[key].a.is_contiguous() and loaded.weights[key].b.dtype == torch.float32
    # an entry path is itself loadable, and checked against the base model
    assert load_adapter(path, llama_spec) == adapter
    assert [p.name for p in (tmp_path / "store").iterdir()] == [f"{adapter.content_hash}.safetensors"]


def test_put_is_idempotent_and_delete(llama_adapter_dir, llama_spec, tmp_path):
    adapter = load_adapter(llama_adapter_dir, llama_spec)
    store = LocalAdapterStore(tmp_path)
    first = store.put(adapter)
    mtime = (tmp_path / first).stat().st_mtime_ns
    assert store.put(adapter) == first and (tmp_path / first).stat().st_mtime_ns == mtime
    assert store.delete(adapter.content_hash) is True
    assert store.delete(adapter.content_hash) is False
    assert not store.exists(adapter.content_hash)
    with pytest.raises(KeyError, match=adapter.content_hash):
        store.get(adapter.content_hash)


def test_bad_hashes_never_touch_paths(tmp_path):
    store = LocalAdapterStore(tmp_path / "s")
    for bad in ["../../etc/passwd", "ABC", "", "g" * 64, "a" * 64 + "\n"]:
        with pytest.raises(ValueError, match="content hash"):
            store.exists(bad)


def test_tampered_entry_is_detected(llama_adapter_dir, llama_spec, tmp_path):
    adapter = load_adapter(llama_adapter_dir, llama_spec)
    store = LocalAdapterStore(tmp_path)
    path = tmp_path / store.put(adapter)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40
    path.write_bytes(bytes(raw))
    store.get(adapter.content_hash)  # without verify the read is a plain load
    with pytest.raises(AdapterValidationError) as info:
        store.get(adapter.content_hash, verify=True)
    assert info.value.code == ErrorCode.STORE_CORRUPT
    with pytest.raises(AdapterValidationError):
        load_adapter(path, llama_spec)  # an entry given as a path is always verified


def test_entry_for_another_base_model(llama_adapter_dir, llama_spec, tmp_path):
    store = LocalAdapterStore(tmp_path)
    path = store.put(load_adapter(llama_adapter_dir, llama_spec))
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(path, BaseModelSpec.from_config(SMOLLM2))
    assert info.value.code == ErrorCode.BASE_MODEL_MISMATCH


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import loraplex.adapters.store as store_module

    adapter = _synthetic(BaseModelSpec.from_config({**SMOLLM2, "num_hidden_layers": 1}), rank=2)
    store = LocalAdapterStore(tmp_path)

    def broken_save(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(store_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        store.put(adapter)
    assert list(tmp_path.iterdir()) == [] and not store.exists(adapter.content_hash)


def test_golden_hash():
    # The hash names stored versions: a change to the serialization must be deliberate (new FORMAT_VERSION).
    weights = {(1, "v_proj"): LoraWeights(torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                          torch.full((4, 2), 0.5)),
               (0, "down_proj"): LoraWeights(torch.ones(1, 2), -torch.ones(3, 1))}
    assert content_hash(weights) == "d795b669dbd04c70bd89c6b6eabbf36ef2a5d91e57960c18839ad961897d7983"
    assert content_hash(dict(reversed(weights.items()))) == content_hash(weights)
    changed = {**weights, (0, "down_proj"): LoraWeights(torch.ones(1, 2), torch.ones(3, 1))}
    assert content_hash(changed) != content_hash(weights)


def test_hash_changes_with_scaling(adapter_copy, llama_spec):
    before = load_adapter(adapter_copy.path, llama_spec)
    adapter_copy.update_config(lora_alpha=32)
    after = load_adapter(adapter_copy.path, llama_spec)
    assert after.content_hash != before.content_hash
    torch.testing.assert_close(after.weights[(0, "q_proj")].b, before.weights[(0, "q_proj")].b * 2)


def test_validation_error_survives_pickling():
    err = pickle.loads(pickle.dumps(AdapterValidationError("bad thing", ErrorCode.NON_FINITE)))
    assert str(err) == "bad thing" and err.code == ErrorCode.NON_FINITE


def test_load_speed_rank16_smollm2_shape(tmp_path):
    """Not a timing assertion: prints how long a rank-16 all-projection adapter for a 30-layer, 576-hidden
    model takes to load from a store entry (run with -s to see it)."""
    spec = BaseModelSpec.from_config(SMOLLM2)
    adapter = _synthetic(spec, rank=16)
    store = LocalAdapterStore(tmp_path)
    store.put(adapter)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        loaded = store.get(adapter.content_hash)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    store.get(adapter.content_hash, verify=True)
    verified = time.perf_counter() - start
    assert loaded == adapter and len(loaded.weights) == 30 * 7
    print(f"\nstore.get rank-16 x 7 modules x 30 layers ({adapter.nbytes / 2**20:.1f} MiB fp32): "
          f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms; "
          f"with hash verification {verified * 1e3:.1f} ms")
