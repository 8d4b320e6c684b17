"""Where the engine's adapters come from: user paths become `LoRARequest`s named by content hash, and the
adapter cache loads weights from the store (canonical, fast) or the original PEFT files."""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.adapters import (
    AdapterLimits,
    AdapterStore,
    AdapterValidationError,
    BaseModelSpec,
    CanonicalAdapter,
    ErrorCode,
    load_adapter,
)
from loraplex.engine.lora_request import LoRARequest


def module_weights(adapter: CanonicalAdapter) -> dict:
    return {key: (w.a, w.b) for key, w in adapter.weights.items()}


class AdapterSource:
    def __init__(self, spec: BaseModelSpec, store: AdapterStore | None = None, limits: AdapterLimits | None = None):
        self.spec = spec
        self.store = store
        self.limits = limits or AdapterLimits()
        # path -> (file fingerprint, request): a batch naming one folder 32 times validates it once
        self._resolved: dict[str, tuple[tuple, LoRARequest]] = {}

    def resolve(self, adapter: str | Path | LoRARequest) -> tuple[LoRARequest, CanonicalAdapter | None]:
        """A LoRARequest for a PEFT folder/archive (validated and hashed now; the weights come back too so
        the caller need not read them twice) or the request itself."""
        if isinstance(adapter, LoRARequest):
            return adapter, None
        if not str(adapter).strip():  # Path("") is the working directory, which is not what anyone meant
            raise AdapterValidationError("the adapter path is empty (None means the base model)",
                                         ErrorCode.NOT_FOUND)
        path = Path(adapter).expanduser()  # "~/adapters/x" means the home folder's, as in a shell (and vLLM)
        # The request keeps the absolute path: the cache reloads an evicted adapter from it later, maybe after
        # the working directory has changed.
        absolute = str(path.absolute())
        stamp = _fingerprint(path)
        known = self._resolved.get(absolute)
        if known is not None and stamp is not None and known[0] == stamp:
            return known[1], None
        canonical = load_adapter(path, self.spec, self.limits)
        where = absolute
        if self.store is not None:
            where = self.store.put(canonical)
        name = path.name[: -len(".tar.gz")] if path.name.endswith(".tar.gz") else path.stem or path.name
        lora = LoRARequest(name=name, content_hash=canonical.content_hash, path=where)
        if stamp is not None:
            self._resolved[absolute] = (stamp, lora)
        return lora, canonical

    def load(self, lora: LoRARequest) -> dict:
        """The adapter cache's load function: per (layer, module) (A, B). Refuses a path whose content no
        longer matches the version the request names."""
        if self.store is not None and self.store.exists(lora.content_hash):
            canonical = self.store.get(lora.content_hash)
        else:
            canonical = load_adapter(lora.path, self.spec, self.limits)
        if canonical.content_hash != lora.content_hash:
            raise AdapterValidationError(
                f"adapter {lora.name!r} at {lora.path} changed: it now hashes to {canonical.content_hash[:12]}, "
                f"not {lora.content_hash[:12]}",
                ErrorCode.STORE_CORRUPT,
            )
        return module_weights(canonical)


def _fingerprint(path: Path, max_entries: int = 256) -> tuple | None:
    """Names, sizes and modification times of the path's files (a folder's, at every depth: an adapter may
    sit in a sub-folder): any rewrite of the adapter changes it, so a changed adapter is validated and hashed
    again. None (nothing remembered) for a folder too large to be an adapter or that cannot be read."""
    try:
        if not path.is_dir():
            st = path.stat()
            return ((path.name, st.st_size, st.st_mtime_ns),)
        entries = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                entries.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
                if len(entries) > max_entries:
                    return None
        return tuple(entries)
    except OSError:
        return None
