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


def check_lora_request(lora: object) -> None:
    """Refuse a LoRARequest whose fields are not strings, saying why: vLLM's LoRARequest is (lora_name,
    lora_int_id, lora_path), and `LoRARequest("sql", 1, path)` written for it would otherwise fail only when
    the adapter loads, with a message about an int."""
    from loraplex.engine.errors import InvalidRequestError

    if not isinstance(lora, LoRARequest):
        return
    for field in ("name", "content_hash", "path"):
        value = getattr(lora, field)
        if not isinstance(value, str) or (field == "content_hash" and not value):
            raise InvalidRequestError(
                f"LoRARequest(name, content_hash, path) takes strings; its {field} is {value!r}. It is not vLLM's "
                "LoRARequest(lora_name, lora_int_id, lora_path): pass the adapter's path as adapter=, or the "
                "LoRARequest that register_adapter or resolve_adapter returns", param="adapter")
