"""Canonical adapter weights: per (layer, projection) A [r, in] and B [out, r] in fp32, with the LoRA scaling
already folded into B, so y = x @ W.T + (x @ A.T) @ B.T. LoRA on the input embedding and the LM head is kept
the same way under layer TOP_LEVEL (the embedding's input being the token's one-hot row: A [r, vocab]).
The content hash names an immutable version."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .errors import AdapterValidationError, ErrorCode
from .spec import MODULES, TOP_LEVEL, TOP_MODULES, BaseModelSpec

FORMAT = "loraplex-canonical"
FORMAT_VERSION = "1"
_MODULE_ORDER = {m: i for i, m in enumerate((*MODULES, *TOP_MODULES))}


def _order(item) -> tuple[int, int]:
    (layer, module), _ = item
    return layer, _MODULE_ORDER[module]


def where(layer: int, module: str) -> str:
    """A canonical entry's name in messages: "layer 3 q_proj", or "lm_head"."""
    return module if layer == TOP_LEVEL else f"layer {layer} {module}"


@dataclass(frozen=True, eq=False)
class LoraWeights:
    a: torch.Tensor  # [r, in_features], fp32, contiguous
    b: torch.Tensor  # [out_features, r], fp32, contiguous, scaling folded in

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> torch.Tensor:
        """The dense weight update [out, in] this pair adds to the base projection."""
        return self.b @ self.a


@dataclass(frozen=True, eq=False)
class CanonicalAdapter:
    """An adapter in loraplex's own form. `weights` is keyed by (layer, module), module one of MODULES, or
    (TOP_LEVEL, embed_tokens | lm_head). Tensors are shared, never copied on access: treat them as read-only."""

    weights: Mapping[tuple[int, str], LoraWeights]
    content_hash: str
    architecture: str
    num_layers: int
    base_model_name_or_path: str | None = None
    _by_layer: Mapping[int, Mapping[str, LoraWeights]] = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, weights: Mapping[tuple[int, str], LoraWeights], *, architecture: str, num_layers: int,
              base_model_name_or_path: str | None = None) -> CanonicalAdapter:
        ordered = dict(sorted(weights.items(), key=_order))
        return cls(weights=MappingProxyType(ordered), content_hash=content_hash(ordered),
                   architecture=architecture, num_layers=num_layers,
                   base_model_name_or_path=base_model_name_or_path)

    def __post_init__(self) -> None:
        by_layer: dict[int, dict[str, LoraWeights]] = {}
        for (layer, module), w in self.weights.items():
            by_layer.setdefault(layer, {})[module] = w
        object.__setattr__(self, "_by_layer", MappingProxyType(
            {k: MappingProxyType(v) for k, v in by_layer.items()}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CanonicalAdapter) and other.content_hash == self.content_hash

    def __hash__(self) -> int:
        return hash(self.content_hash)

    def layer(self, index: int) -> Mapping[str, LoraWeights]:
        """module -> weights for one layer (empty when the adapter leaves that layer alone)."""
        return self._by_layer.get(index, MappingProxyType({}))

    @property
    def rank(self) -> int:
        """The largest rank over all modules (rank_pattern may give modules different ranks)."""
        return max(w.rank for w in self.weights.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {m for _, m in self.weights}
        return tuple(m for m in (*MODULES, *TOP_MODULES) if m in present)

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers the adapter changes (LoRA on embed_tokens or lm_head is in `layer(TOP_LEVEL)`)."""
        return tuple(sorted(k for k in self._by_layer if k != TOP_LEVEL))

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())

    def check_compatible(self, spec: BaseModelSpec) -> None:
        """Refuse weights whose shapes do not fit `spec` (an entry made for another base model)."""
        for (layer, module), w in self.weights.items():
            shape = spec.shape(layer, module)
            if shape is None:
                raise AdapterValidationError(
                    f"adapter {self.content_hash[:12]} has weights for {where(layer, module)}, which "
                    f"{spec.architecture} with {spec.num_layers} layers does not have", ErrorCode.BASE_MODEL_MISMATCH)
            if w.a.shape[1] != shape.in_features or w.b.shape[0] != shape.out_features:
                raise AdapterValidationError(
                    f"adapter {self.content_hash[:12]} {where(layer, module)}: A {tuple(w.a.shape)}, "
                    f"B {tuple(w.b.shape)} do not fit in={shape.in_features}, out={shape.out_features}",
                    ErrorCode.BASE_MODEL_MISMATCH)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Flat tensors and string metadata, as the store writes them to one safetensors file."""
        tensors = {}
        for (layer, module), w in self.weights.items():
            name = module if layer == TOP_LEVEL else f"layers.{layer}.{module}"
            tensors[f"{name}.lora_a"] = w.a
            tensors[f"{name}.lora_b"] = w.b
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "content_hash": self.content_hash,
                "architecture": self.architecture, "num_layers": str(self.num_layers)}
        if self.base_model_name_or_path:
            meta["base_model_name_or_path"] = self.base_model_name_or_path
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], *,
                     verify: bool = False) -> CanonicalAdapter:
        """Inverse of `to_tensors`. With verify, recompute the hash and refuse a mismatch (bit rot, tampering)."""
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise AdapterValidationError(f"not a {FORMAT} v{FORMAT_VERSION} entry (metadata {dict(meta)!r})",
                                         ErrorCode.STORE_CORRUPT)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            parts = key.split(".")
            if len(parts) == 2 and parts[0] in TOP_MODULES and parts[1] in ("lora_a", "lora_b"):
                pairs.setdefault((TOP_LEVEL, parts[0]), {})[parts[1]] = tensor
                continue
            if len(parts) != 4 or parts[0] != "layers" or parts[2] not in MODULES \
                    or parts[3] not in ("lora_a", "lora_b") or not (parts[1].isascii() and parts[1].isdigit()):
                raise AdapterValidationError(f"unexpected tensor {key!r} in a canonical entry", ErrorCode.STORE_CORRUPT)
            pairs.setdefault((int(parts[1]), parts[2]), {})[parts[3]] = tensor
        if not pairs:
            raise AdapterValidationError("canonical entry holds no weights", ErrorCode.STORE_CORRUPT)
        weights = {}
        for k, pair in pairs.items():
            if set(pair) != {"lora_a", "lora_b"}:
                raise AdapterValidationError(f"canonical entry lacks A or B for {k}", ErrorCode.STORE_CORRUPT)
            weights[k] = _checked(k, pair["lora_a"], pair["lora_b"], finite=verify)
        ordered = dict(sorted(weights.items(), key=_order))
        stored = meta.get("content_hash", "")
        if verify and content_hash(ordered) != stored:
            raise AdapterValidationError(f"canonical entry {stored[:12]} does not match its content hash",
                                         ErrorCode.STORE_CORRUPT)
        return cls(weights=MappingProxyType(ordered), content_hash=stored, architecture=meta.get("architecture", ""),
                   num_layers=int(meta.get("num_layers", "0")),
                   base_model_name_or_path=meta.get("base_model_name_or_path"))


def _checked(key: tuple[int, str], a: torch.Tensor, b: torch.Tensor, *, finite: bool) -> LoraWeights:
    """The pair as a canonical entry must hold it: fp32 matrices A [r, in] and B [out, r], r >= 1, and (when
    the entry is not one of the store's own) finite values."""
    place = f"canonical entry, {where(*key)}"
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise AdapterValidationError(f"{place}: A is {a.dtype} and B {b.dtype}; canonical entries hold fp32",
                                     ErrorCode.DTYPE_UNSUPPORTED)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] < 1 or a.shape[0] != b.shape[1]:
        raise AdapterValidationError(f"{place}: A {list(a.shape)} and B {list(b.shape)} are not a LoRA pair "
                                     f"(A [r, in], B [out, r])", ErrorCode.RANK_MISMATCH)
    if finite:
        for name, t in (("A", a), ("B", b)):
            if not torch.isfinite(t).all():
                raise AdapterValidationError(f"{place}: {name} has non-finite values (NaN or inf)",
                                             ErrorCode.NON_FINITE)
        check_update_bound(a, b, place)
    return LoraWeights(a, b)


# Each entry of an update B @ A (the scaling folded into B) is at most r * max|A| * max|B|. Trained adapters
# stay within the thousands (r 64, |A| and |B| near 1, a scaling of 16); an update that can reach a million
# times an activation turns the model's output to noise, and soon to inf and NaN (the MLP multiplies two
# such outputs, RMSNorm squares them). The engine also fails a request whose logits are not finite.
MAX_UPDATE_BOUND = 1e6


def check_update_bound(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    if a.numel() == 0 or b.numel() == 0:
        return
    bound = a.shape[0] * float(a.abs().max()) * float(b.abs().max())
    if not bound <= MAX_UPDATE_BOUND:  # also catches inf
        raise AdapterValidationError(f"{where}: the weights are so large that the update B @ A can overflow "
                                     f"(r * max|A| * max|B| = {bound:.3g}, over {MAX_UPDATE_BOUND:.0e})",
                                     ErrorCode.NON_FINITE)


def content_hash(weights: Mapping[tuple[int, str], LoraWeights]) -> str:
    """sha256 over a fixed serialization: a format line, then per (layer, module) in canonical order a line
    with the name and shapes followed by A's and B's fp32 little-endian bytes. Nothing about the container
    the adapter arrived in (folder, zip, tar) or its file order enters the hash."""
    h = hashlib.sha256(f"{FORMAT} v{FORMAT_VERSION}\n".encode())
    for (layer, module), w in sorted(weights.items(), key=_order):
        a, b = w.a, w.b
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            raise TypeError("canonical weights are fp32")
        name = module if layer == TOP_LEVEL else f"{layer}.{module}"
        h.update(f"{name} a={list(a.shape)} b={list(b.shape)}\n".encode())
        h.update(a.contiguous().numpy().data)
        h.update(b.contiguous().numpy().data)
    return h.hexdigest()
