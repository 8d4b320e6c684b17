"""The adapter store in an S3-compatible bucket (AWS S3, MinIO, R2, ...), for deployments where the
control plane and several engine machines share one set of adapter versions."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save

from .canonical import CanonicalAdapter
from .errors import AdapterValidationError, ErrorCode
from .safetensors_file import tensors_from_bytes
from .store import ENTRY_LIMITS, HASH_RE, SUFFIX, LocalAdapterStore


class S3AdapterStore:
    """Entries are objects `<prefix><content_hash>.safetensors`. An S3 PUT is atomic (readers see no object
    or all of it), so no temporary key is needed. With `cache_dir`, entries read or written are also kept in
    a LocalAdapterStore there, so an engine fetches each version from the bucket once."""

    def __init__(self, bucket: str, *, prefix: str = "adapters/", client=None, cache_dir: str | Path | None = None,
                 **client_kwargs):
        if client is None:
            try:
                import boto3
            except ImportError as exc:
                raise RuntimeError("the S3 adapter store needs boto3: pip install 'loraplex[s3]'") from exc
            client = boto3.client("s3", **client_kwargs)
        self.client = client
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.cache = LocalAdapterStore(cache_dir) if cache_dir is not None else None

    def key(self, content_hash: str) -> str:
        if not HASH_RE.fullmatch(content_hash or ""):
            raise ValueError(f"not a content hash: {content_hash!r} (expected 64 lowercase hex digits)")
        return f"{self.prefix}{content_hash}{SUFFIX}"

    def put(self, adapter: CanonicalAdapter) -> str:
        key = self.key(adapter.content_hash)
        if not self.exists(adapter.content_hash):
            tensors, meta = adapter.to_tensors()
            self.client.put_object(Bucket=self.bucket, Key=key, Body=save(tensors, metadata=meta),
                                   ContentType="application/octet-stream")
        if self.cache is not None:
            self.cache.put(adapter)
        return f"s3://{self.bucket}/{key}"

    def get(self, content_hash: str, *, verify: bool = False) -> CanonicalAdapter:
        key = self.key(content_hash)
        if self.cache is not None and self.cache.exists(content_hash):
            return self.cache.get(content_hash, verify=verify)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:
            if _is_missing(exc):
                raise KeyError(f"adapter version {content_hash} is not in s3://{self.bucket}/{self.prefix}") from exc
            raise
        tensors, meta = tensors_from_bytes(body, key, ENTRY_LIMITS)
        adapter = CanonicalAdapter.from_tensors(tensors, meta, verify=verify)
        if adapter.content_hash != content_hash:
            raise AdapterValidationError(f"object {key} names version {adapter.content_hash}", ErrorCode.STORE_CORRUPT)
        if self.cache is not None:
            self.cache.put(adapter)
        return adapter

    def exists(self, content_hash: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(content_hash))
        except Exception as exc:
            if _is_missing(exc):
                return False
            raise
        return True

    def delete(self, content_hash: str) -> bool:
        existed = self.exists(content_hash)
        if existed:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(content_hash))
        if self.cache is not None:
            self.cache.delete(content_hash)
        return existed

    def list(self) -> list[str]:
        hashes = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", ()):
                name = obj["Key"][len(self.prefix):]
                if name.endswith(SUFFIX) and HASH_RE.fullmatch(name[: -len(SUFFIX)]):
                    hashes.append(name[: -len(SUFFIX)])
        return sorted(hashes)


def _is_missing(exc: Exception) -> bool:
    """botocore reports a missing object as a ClientError whose code is 404 / NoSuchKey / NotFound."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def open_store(location: str | Path, *, cache_dir: str | Path | None = None):
    """`s3://bucket/prefix` -> S3AdapterStore (credentials and endpoint from the usual AWS environment, e.g.
    AWS_ENDPOINT_URL for MinIO); anything else is a local folder -> LocalAdapterStore."""
    text = str(location)
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {text!r} (expected s3://bucket/prefix)")
        return S3AdapterStore(bucket, prefix=prefix, cache_dir=cache_dir)
    return LocalAdapterStore(text)
