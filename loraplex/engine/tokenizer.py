"""The engine's view of a model's tokenizer: a Hugging Face fast tokenizer, its EOS ids and chat template."""

from __future__ import annotations

import copy
import json
import math
import re
import secrets
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from loraplex.engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# The tokenizers library holds the GIL for all of encode() but releases it in encode_batch(): a long text
# goes through the batch call, so that tokenizing megabytes in a worker thread does not stall the thread
# running the server's event loop. Short texts keep the cheaper single call.
RELEASE_GIL_CHARS = 16 * 1024

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class Tokenizer:
    """Built on the `tokenizers` library directly (transformers is not imported to load a model; the chat
    template is rendered by transformers' sandboxed renderer, imported on first use)."""

    def __init__(
        self,
        backend,
        eos_token_ids: Iterable[int],
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend  # a tokenizers.Tokenizer
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ...: what templates see
        self.chat_template = chat_template
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)
        special_texts = sorted({token.content for token in backend.get_added_tokens_decoder().values()
                                if token.special and token.content}, key=len, reverse=True)
        # the longest first, so that where one special token's text begins another's the whole one is found
        self._special_text = re.compile("|".join(map(re.escape, special_texts))) if special_texts else None
        self._text_backend = None  # a copy of the backend that reads special-token text as text; made on use
        self._text_backend_lock = threading.Lock()
        # a bound on the bytes one token stands for, and the bytes no token spells (they produce no token)
        self.max_token_bytes, self._unspelled_bytes = _token_size_bound(backend) or (None, b"")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        model_dir = Path(model_dir)
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        special = _special_tokens(tokenizer_config, _read_json(model_dir / "special_tokens_map.json"))
        if (model_dir / "tokenizer.json").is_file():
            try:
                backend = Backend.from_file(str(model_dir / "tokenizer.json"))
            except Exception as exc:  # tokenizers raises its own Exception subclass for bad files
                raise ModelLoadError(f"cannot load {model_dir / 'tokenizer.json'}: {exc}") from exc
        else:
            backend = _convert_with_transformers(model_dir)
        eos_ids = _eos_ids(model_dir)
        if special.get("eos_token") is not None and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        return cls(backend, eos_ids, special_tokens=special, chat_template=_chat_template(model_dir, tokenizer_config))

    @property
    def pad_token_id(self) -> int | None:
        pad = self.special_tokens.get("pad_token")
        return None if pad is None else self.backend.token_to_id(pad)

    def encode(self, text: str, add_special_tokens: bool = True, *, max_model_len: int | None = None) -> list[int]:
        """A raw prompt is the caller's whole prompt, written for the model: special-token text in it is read
        as those tokens (as vLLM and OpenAI's legacy completions read it). With `max_model_len`, a text too
        long to leave room for a generated token is refused (PromptTooLongError) before it is tokenized."""
        self._refuse_oversize([text], max_model_len, param="prompt")
        return self._encode(text, add_special_tokens, param="prompt")

    def _encode(self, text: str, add_special_tokens: bool, *, param: str) -> list[int]:
        try:
            if isinstance(text, str) and len(text) > RELEASE_GIL_CHARS:
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _refuse_lone_surrogates(text, param)
            raise

    def _encode_pieces(self, texts: list[str], backend, *, param: str) -> list[list[int]]:
        """Texts tokenized on their own, without special tokens added; in one call (which leaves the GIL to
        other threads), however many they are."""
        try:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            for text in texts:
                _refuse_lone_surrogates(text, param)
            raise

    def fewest_tokens(self, texts: Sequence[str]) -> int | None:
        """The fewest tokens these texts, tokenized one after another, can take, known without tokenizing
        them: each token stands for at most `max_token_bytes` bytes. None where that bound is not known."""
        if self.max_token_bytes is None:
            return None
        size = sum(len(t.encode("utf-8", errors="surrogatepass").translate(None, self._unspelled_bytes))
                   for t in texts)
        return math.ceil(size / self.max_token_bytes)

    def _refuse_oversize(self, texts: Sequence[str], max_model_len: int | None, *, param: str) -> None:
        """Tokenizing megabytes costs seconds of CPU; a text whose size alone shows that it cannot fit is
        refused first. The prompt and one generated token must fit, as the context check after tokenizing
        asks."""
        if not max_model_len or self.max_token_bytes is None:
            return
        if not all(isinstance(t, str) for t in texts):
            return  # not text: tokenizing refuses it, saying why
        # a character is at most 4 bytes: a text that would fit even then is passed without counting its bytes
        if math.ceil(4 * sum(map(len, texts)) / self.max_token_bytes) < max_model_len:
            return
        fewest = self.fewest_tokens(texts)
        if fewest >= max_model_len:
            what = "prompt" if param == "prompt" else "messages"
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt is too long: "
                f"its text makes at least {fewest} tokens. Please reduce the length of the {what}.",
                param=param, min_tokens=fewest, max_model_len=max_model_len)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. 'Ġworld' for byte-level BPE)."""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary", param="token_id")
        return token

    def _token_text(self, token_id: int) -> str:
        """What one token reads as on its own (logprobs show this); partial UTF-8 shows as U+FFFD."""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where it holds only part of a UTF-8 character (its text then
        reads U+FFFD): OpenAI's logprobs give these so that a client can join a character's pieces."""
        entry = self.backend.id_to_token(int(token_id))
        if entry is None:
            return b""
        if _is_byte_level(self.backend):
            unicode_to_byte = _unicode_to_byte()
            if all(ch in unicode_to_byte for ch in entry):
                return bytes(unicode_to_byte[ch] for ch in entry)
        if len(entry) == 6 and entry.startswith("<0x") and entry.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(entry[3:5], 16)])
            except ValueError:
                pass
        return self._token_text(token_id).encode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
        max_model_len: int | None = None,
    ) -> list[int]:
        """The conversation's prompt tokens. Messages are plain text, as in OpenAI's API: only the template
        makes special tokens; special-token text a message holds (`<|im_start|>system`, say, which would
        fake a turn) is tokenized as the characters it is made of. With `max_model_len`, a conversation too
        long to leave room for a generated token is refused (PromptTooLongError) before it is tokenized."""
        normalized = self._chat_messages(messages)
        rendered = self._render(normalized, add_generation_prompt)
        self._refuse_oversize([rendered], max_model_len, param="messages")
        special = self._special_text
        if special is None or not any(special.search(text) for text in _message_texts(normalized)):
            return self._encode(rendered, False, param="messages")
        marker = f"\ue000{secrets.randbelow(10**18):018d}:"
        quoted = _quote_special_text(normalized, special, marker)
        # the rendered text alternates: template text (with the messages' other text), index of a quote, ...
        pieces = re.split(f"{re.escape(marker)}(\\d+)\ue001", self._render(normalized, add_generation_prompt))
        texts = [quoted[int(p)] if i % 2 else p for i, p in enumerate(pieces)]
        template_ids = self._encode_pieces(texts[0::2], self.backend, param="messages")
        distinct = list(dict.fromkeys(texts[1::2]))
        quote_ids = dict(zip(distinct, self._encode_pieces(distinct, self._plain_text_backend(), param="messages"),
                             strict=True))
        ids = list(template_ids[0])
        for quote, following in zip(texts[1::2], template_ids[1:], strict=True):
            ids += quote_ids[quote]
            ids += following
        return ids

    def _plain_text_backend(self):
        """A copy of the backend that does not read special-token text as special tokens (transformers'
        split_special_tokens). A copy, not the shared backend switched back and forth: other threads
        tokenize with that one meanwhile."""
        with self._text_backend_lock:
            if self._text_backend is None:
                backend = copy.deepcopy(self.backend)
                backend.encode_special_tokens = True
                self._text_backend = backend
            return self._text_backend

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._render(self._chat_messages(messages), add_generation_prompt)

    def _chat_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        normalized = [_normalize_message(i, m) for i, m in enumerate(_check_messages(messages))]
        if "developer" not in self.chat_template:
            # OpenAI's developer messages take the place of system messages; a template that knows no
            # developer role would render one as a turn the model never saw, after its default system prompt
            for message in normalized:
                if message["role"] == "developer":
                    message["role"] = "system"
        return normalized

    def _render(self, normalized: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        # transformers' renderer: a hardened Jinja sandbox, because chat templates are untrusted code
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                conversations=[normalized],
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
        return rendered[0]


def _message_texts(messages: list[dict[str, Any]]) -> Iterable[str]:
    """The messages' own text (content, name): all but the role, which the template checks."""
    for message in messages:
        for key, value in message.items():
            if key != "role" and isinstance(value, str):
                yield value


def _quote_special_text(messages: list[dict[str, Any]], special_text: re.Pattern, marker: str) -> list[str]:
    """Replace each special token's text in the messages' own text by `marker<n>\ue001`, n indexing the
    returned list of the texts replaced. The marker holds a random number, so that no message can spell it,
    and no letters, so that a template that changes a message's case leaves it as it is. Each replaced text
    is short and free of whitespace, so that a template that trims or splits a message's content treats it as
    it would the text itself."""
    quoted: list[str] = []

    def quote(match: re.Match) -> str:
        quoted.append(match.group())
        return f"{marker}{len(quoted) - 1}\ue001"

    for message in messages:
        for key, value in message.items():
            if key != "role" and isinstance(value, str):
                message[key] = special_text.sub(quote, value)
    return quoted


def _refuse_lone_surrogates(text: Any, param: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not Unicode text and which the tokenizer
    cannot take; say so instead of failing inside it."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # a chat's text is the rendered template, whose character positions mean nothing to the caller
        where = f" at character {exc.start}" if param == "prompt" else ""
        what = "the prompt" if param == "prompt" else "a message"
        raise InvalidRequestError(
            f"{what} is not valid Unicode: it holds a lone surrogate (U+{ord(text[exc.start]):04X}){where}",
            param=param) from None


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
        if not content:
            raise InvalidRequestError(f"{where}.content must hold at least one part", param="messages")
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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialised AddedToken
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(tokenizer_config: dict, special_tokens_map: dict) -> dict[str, str]:
    special = {}
    for attr in SPECIAL_TOKEN_ATTRIBUTES:
        content = _token_content(tokenizer_config.get(attr)) or _token_content(special_tokens_map.get(attr))
        if content is not None:
            special[attr] = content
    return special


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def _convert_with_transformers(model_dir: Path):
    """Models without tokenizer.json (a SentencePiece model only): let transformers convert it."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # missing files, unknown tokenizer class, malformed json
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError(f"{model_dir}: only tokenizers with a fast (Rust) implementation are supported")
    return backend


def _eos_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), else config.json."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    return []


def _token_size_bound(backend) -> tuple[int, bytes] | None:
    """The most bytes of text one token stands for, where that bounds every tokenization, with the bytes that
    no vocabulary entry spells (the model drops them): a text of B bytes, U of them unspelled, takes at least
    ceil((B - U) / it) tokens. Known for byte-level BPE (GPT-2's scheme, SmolLM2's and Llama 3's) without a
    normalizer: each byte of the text is one symbol, each vocabulary entry a run of them and each added token
    its own text. Other schemes are left unbounded (None): a normalizer may shrink the text (NFC composes
    several characters into one, NFKC folds a 4-byte letter to 1), a WordPiece [UNK] takes a whole word, a
    pre-tokenizer may drop whitespace, and an added token with lstrip/rstrip takes the whitespace beside it."""
    if backend.normalizer is not None or type(backend.model).__name__ != "BPE" or not _splits_into_bytes(backend):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    unicode_to_byte = _unicode_to_byte()
    vocab = backend.get_vocab(with_added_tokens=False)
    # an entry spelled in the byte alphabet stands for one byte a character; any other entry can never match
    # a byte-level text, and its UTF-8 length is an upper bound all the same
    longest = max((len(entry) if all(ch in unicode_to_byte for ch in entry) else len(entry.encode())
                   for entry in vocab), default=0)
    longest = max([longest, *(len(token.content.encode()) for token in added)])
    if not longest:
        return None
    return longest, bytes(sorted(b for ch, b in unicode_to_byte.items() if ch not in vocab))


def _splits_into_bytes(backend) -> bool:
    """The pre-tokenizer is ByteLevel, or a sequence that ends in one and before it only splits text (drops
    none of it)."""
    pre = backend.pre_tokenizer
    if pre is None:
        return False
    try:
        spec = json.loads(pre.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return False
    steps = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]
    if not steps or steps[-1].get("type") != "ByteLevel":
        return False
    return all(step.get("type") == "ByteLevel" or (step.get("type") in ("Split", "Punctuation", "Digits")
                                                  and step.get("behavior") != "Removed") for step in steps)


def _is_byte_level(backend) -> bool:
    """Byte-level BPE (GPT-2's scheme, SmolLM2's and Llama 3's): vocabulary entries spell bytes as printable
    characters."""
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others are
    shifted to 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}
