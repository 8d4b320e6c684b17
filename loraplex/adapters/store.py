"""Where canonical adapter versions live, named by content hash. Entries are immutable: putting the same
weights twice is a no-op, and a reader never sees a half-written entry."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

from safetensors.torch import save_file

from .canonical import CanonicalAdapter
from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits
from .safetensors_file import read_tensors

HASH_RE = re.compile(r"^[0-9a-f]{64}$")
SUFFIX = ".safetensors"
# Entries were validated on the way in; these limits only guard against a damaged file.
ENTRY_LIMITS = AdapterLimits(max_member_bytes=1 << 40, max_header_bytes=64 * 1024 * 1024)


@runtime_checkable
class AdapterStore(Protocol):
    """What the engine and control plane need from adapter storage; a local folder implements it, and an
    S3-compatible bucket can (keys `<hash>.safetensors`, upload to a temporary key then copy)."""

    def put(self, adapter: CanonicalAdapter) -> str:
        """Store the version if absent; return where it lives (a path or URL)."""
        ...

    def get(self, content_hash: str, *, verify: bool = False) -> CanonicalAdapter: ...

    def exists(self, content_hash: str) -> bool: ...

    def delete(self, content_hash: str) -> bool:
        """True when something was deleted."""
        ...

    def list(self) -> list[str]:
        """Content hashes of all stored versions, sorted."""
        ...


class LocalAdapterStore:
    """A folder of `<content_hash>.safetensors` files (fp32, contiguous: loading is one read per tensor)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, content_hash: str) -> Path:
        if not HASH_RE.fullmatch(content_hash or ""):
            raise ValueError(f"not a content hash: {content_hash!r} (expected 64 lowercase hex digits)")
        return self.root / f"{content_hash}{SUFFIX}"

    def put(self, adapter: CanonicalAdapter) -> str:
        target = self.path(adapter.content_hash)
        if target.exists():
            return str(target)
        tensors, meta = adapter.to_tensors()
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=self.root)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            # Same folder, so the rename is atomic: readers see no entry or the whole entry.
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return str(target)

    def get(self, content_hash: str, *, verify: bool = False) -> CanonicalAdapter:
        target = self.path(content_hash)
        if not target.exists():
            raise KeyError(f"adapter version {content_hash} is not in the store at {self.root}")
        adapter = read_entry(target, verify=verify)
        if adapter.content_hash != content_hash:
            raise AdapterValidationError(f"store entry {target.name} names version {adapter.content_hash}",
                                         ErrorCode.STORE_CORRUPT)
        return adapter

    def exists(self, content_hash: str) -> bool:
        return self.path(content_hash).exists()

    def delete(self, content_hash: str) -> bool:
        try:
            self.path(content_hash).unlink()
        except FileNotFoundError:
            return False
        return True

    def list(self) -> list[str]:
        return sorted(p.name[: -len(SUFFIX)] for p in self.root.glob(f"*{SUFFIX}") if HASH_RE.fullmatch(p.stem))


def read_entry(path: str | Path, *, verify: bool = False) -> CanonicalAdapter:
    """A canonical entry file as written by LocalAdapterStore.put, read into memory (not mapped)."""
    tensors, meta = read_tensors(Path(path), ENTRY_LIMITS)
    return CanonicalAdapter.from_tensors(tensors, meta, verify=verify)
