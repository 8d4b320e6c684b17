"""S3AdapterStore against moto's in-memory S3 (the same boto3 calls a real bucket or MinIO answers)."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters import (
    AdapterStore,
    AdapterValidationError,
    LocalAdapterStore,
    S3AdapterStore,
    load_adapter,
    open_store,
)

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")


@pytest.fixture
def s3(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with moto.mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="lpx")
        yield client


@pytest.fixture
def adapter(llama_adapter_dir, llama_spec):
    return load_adapter(llama_adapter_dir, llama_spec)


def test_round_trip(s3, adapter):
    store = S3AdapterStore("lpx", prefix="tenants/adapters", client=s3)
    assert isinstance(store, AdapterStore)
    assert not store.exists(adapter.content_hash) and store.list() == []
    url = store.put(adapter)
    assert url == f"s3://lpx/tenants/adapters/{adapter.content_hash}.safetensors"
    s3.put_object(Bucket="lpx", Key="tenants/adapters/README.txt", Body=b"not an entry")
    assert store.exists(adapter.content_hash) and store.list() == [adapter.content_hash]
    loaded = store.get(adapter.content_hash, verify=True)
    assert loaded == adapter
    for key, w in adapter.weights.items():
        assert torch.equal(loaded.weights[key].b, w.b)
    assert store.delete(adapter.content_hash) and not store.delete(adapter.content_hash)
    with pytest.raises(KeyError, match=adapter.content_hash):
        store.get(adapter.content_hash)


def test_cache_dir_keeps_a_local_copy(s3, adapter, tmp_path):
    store = S3AdapterStore("lpx", client=s3, cache_dir=tmp_path / "cache")
    other_machine = S3AdapterStore("lpx", client=s3)
    other_machine.put(adapter)
    assert store.get(adapter.content_hash) == adapter
    assert LocalAdapterStore(tmp_path / "cache").exists(adapter.content_hash)
    s3.delete_object(Bucket="lpx", Key=store.key(adapter.content_hash))
    assert store.get(adapter.content_hash) == adapter  # served from the cache now


def test_tampered_object(s3, adapter):
    store = S3AdapterStore("lpx", client=s3)
    store.put(adapter)
    key = store.key(adapter.content_hash)
    body = bytearray(s3.get_object(Bucket="lpx", Key=key)["Body"].read())
    body[-1] ^= 0x01
    s3.put_object(Bucket="lpx", Key=key, Body=bytes(body))
    with pytest.raises(AdapterValidationError):
        store.get(adapter.content_hash, verify=True)


def test_open_store(s3, tmp_path):
    local = open_store(tmp_path / "here")
    assert isinstance(local, LocalAdapterStore)
    remote = open_store("s3://lpx/some/prefix")
    assert isinstance(remote, S3AdapterStore) and remote.bucket == "lpx" and remote.prefix == "some/prefix/"
    with pytest.raises(ValueError, match="bucket"):
        open_store("s3:///x")
