"""The engine's view of a model's tokenizer: a Hugging Face fast tokenizer plus EOS ids and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from loraplex.engine.errors import InvalidRequestError, ModelLoadError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: Iterable[int]):
        self.hf = hf_tokenizer
        # the Rust tokenizer directly: per-token decode calls skip the Python wrapper's overhead
        self.backend = hf_tokenizer.backend_tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.vocab_size: int = len(hf_tokenizer)
        self.special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:  # missing files, unknown tokenizer class, malformed json
            raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
        if not getattr(hf, "is_fast", False) or getattr(hf, "backend_tokenizer", None) is None:
            raise ModelLoadError(f"{model_dir}: only fast (tokenizers-backed) tokenizers are supported")
        return cls(hf, _eos_ids(model_dir, hf))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. 'Ġworld' for byte-level BPE)."""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary", param="token_id")
        return token

    def _token_text(self, token_id: int) -> str:
        """What one token reads as on its own (logprobs show this); partial UTF-8 shows as U+FFFD."""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        normalized = [_normalize_message(i, m) for i, m in enumerate(_check_messages(messages))]
        try:
            text = self.hf.apply_chat_template(
                normalized, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
        return text


def _check_messages(messages: Any) -> list[Any]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    return list(messages)


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with role and content", param="messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}", param="messages"
        )
    content = message.get("content")
    if isinstance(content, list):
        # OpenAI's content parts: only text can be rendered by a text model
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.content may only hold text parts", param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"{where}.content must be a string", param="messages")
    normalized = {key: value for key, value in message.items() if key not in ("role", "content")}
    normalized.update(role=role, content=content)
    return normalized


def _eos_ids(model_dir: Path, hf) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), config.json, and the tokenizer itself."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
        if ids:
            break  # the generation config, when it names EOS, is the model author's final word
    if hf.eos_token_id is not None:
        ids.append(int(hf.eos_token_id))
    return ids
