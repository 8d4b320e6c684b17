"""How a request names its adapter. The engine keys everything (slots, prefix hashes) by content hash."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An immutable adapter version.

    name: what the user called it (for logs and metrics only).
    content_hash: sha256 of the canonical weights; identifies the version everywhere in the engine.
    path: where the adapter can be loaded from (a PEFT directory/archive or a canonical store entry).
    """

    name: str
    content_hash: str
    path: str

    @property
    def key(self) -> str:
        return self.content_hash
