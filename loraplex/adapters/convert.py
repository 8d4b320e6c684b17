"""PEFT tensors + LoraSettings -> canonical weights, refusing every tensor that does not fit exactly."""

from __future__ import annotations

import re

import torch

from .canonical import CanonicalAdapter, LoraWeights, check_update_bound, where
from .errors import AdapterValidationError, ErrorCode
from .peft_config import LoraSettings
from .spec import TOP_LEVEL, TOP_MODULES, BaseModelSpec

_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")
# PEFT's Embedding LoRA saves its pair as parameters of the module itself: lora_embedding_A [r, vocab] and
# lora_embedding_B [hidden, r]
_EMBEDDING_KEY = re.compile(r"^(?P<path>.+)\.lora_embedding_(?P<ab>[AB])$")
_BASE_COPY = re.compile(rf"^{re.escape(_PREFIX)}(?P<path>.+)\.base_layer\.weight$")
_EMBEDDING = "embed_tokens"


def _tensor_name(module: str, ab: str) -> str:
    return f"lora_embedding_{ab}" if module == _EMBEDDING else f"lora_{ab}.weight"


def to_canonical(tensors: dict[str, torch.Tensor], settings: LoraSettings, spec: BaseModelSpec) -> CanonicalAdapter:
    paths = {spec.module_path(i, m): (i, m) for i in range(spec.num_layers) for m in spec.peft_modules}
    paths.update({spec.module_path(TOP_LEVEL, m): (TOP_LEVEL, m) for m in TOP_MODULES})
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        if _training_only(key, settings, paths) or _base_copy(key, tensor, settings, spec, paths):
            continue
        path = _module_path(key)
        target = paths.get(path)
        if target is None:
            module = path.rsplit(".", 1)[-1] if path else None
            if module is not None and module not in spec.peft_modules:
                raise AdapterValidationError(
                    f"{_WEIGHTS}: tensor {key!r} adapts {module!r}, which is not a projection of "
                    f"{spec.architecture}; known modules: {', '.join((*spec.peft_modules, *TOP_MODULES))}",
                    ErrorCode.UNKNOWN_TARGET_MODULE)
            layer = re.match(rf"^{re.escape(spec.layer_prefix)}\.(\d+)\.", path or "")
            if layer is not None and int(layer[1]) >= spec.num_layers:
                raise AdapterValidationError(
                    f"{_WEIGHTS}: tensor {key!r} is for layer {int(layer[1])}, but {spec.architecture} here has "
                    f"{spec.num_layers} layers (0..{spec.num_layers - 1}): an adapter for a deeper model?"
                    f"{_made_for(settings, spec)}",
                    ErrorCode.LAYER_OUT_OF_RANGE)
            raise AdapterValidationError(
                f"{_WEIGHTS}: unknown tensor {key!r}; expected "
                f"'{_PREFIX}{spec.layer_prefix}.<layer>.<self_attn|mlp>.<module>.lora_A|lora_B.weight'",
                ErrorCode.UNKNOWN_TENSOR)
        if target == (TOP_LEVEL, "lm_head") and settings.tied_lm_head:
            continue  # PEFT's copy of the pair tied to the embedding's, which the head's LoRA is made from below
        if target not in settings.targets:
            raise AdapterValidationError(
                f"{_WEIGHTS}: tensor {key!r} is for {where(*target)}, which adapter_config.json does "
                f"not target (target_modules / layers_to_transform)", ErrorCode.UNKNOWN_TENSOR)
        embedding_key = _EMBEDDING_KEY.match(key)
        if (embedding_key is not None) != (target[1] == _EMBEDDING):
            expected = "lora_embedding_A / lora_embedding_B" if target[1] == _EMBEDDING else \
                "lora_A.weight / lora_B.weight"
            raise AdapterValidationError(
                f"{_WEIGHTS}: tensor {key!r} does not fit {where(*target)}: PEFT saves LoRA on "
                f"{'an embedding' if target[1] == _EMBEDDING else 'a linear layer'} as {expected}",
                ErrorCode.UNKNOWN_TENSOR)
        ab = (embedding_key or _KEY.match(key))["ab"]
        found.setdefault(target, {})[ab] = (key, tensor)

    weights: dict[tuple[int, str], LoraWeights] = {}
    for layer, module in sorted(settings.targets):
        pair = found.get((layer, module), {})
        if (layer, module) == (TOP_LEVEL, "lm_head") and settings.tied_lm_head:
            # the embedding's pair, transposed: A [r, hidden] is its B^T, B [vocab, r] its A^T (PEFT's tied adapter)
            embedding = found[(TOP_LEVEL, _EMBEDDING)]
            pair = {ab: (f"{key} (transposed: the LM head's LoRA is tied to the embedding's)", tensor.t())
                    for ab, (key, tensor) in (("A", embedding["B"]), ("B", embedding["A"]))}
        for ab in "AB":
            if ab not in pair:
                raise AdapterValidationError(
                    f"{_WEIGHTS}: missing tensor {_PREFIX}{spec.module_path(layer, module)}."
                    f"{_tensor_name(module, ab)} ({where(layer, module)} is targeted but has no "
                    f"{_tensor_name(module, ab).split('.')[0]})", ErrorCode.MISSING_TENSOR)
        a, b = _checked_pair(pair["A"], pair["B"], layer, module, settings, spec)
        if layer == TOP_LEVEL:
            weights[(layer, module)] = LoraWeights(a, b)
            continue
        slices = spec.peft_modules[module]
        for s in slices:
            # A fused projection (qkv_proj, gate_up_proj) becomes one pair per logical projection: a copy of
            # A each (entries are saved as unshared tensors), and the rows of B for that projection's slice.
            a_own = a if len(slices) == 1 else a.clone()
            weights[(layer, s.module)] = LoraWeights(a_own, b[s.start:s.stop].contiguous())
    return CanonicalAdapter.build(weights, architecture=spec.architecture, num_layers=spec.num_layers,
                                  base_model_name_or_path=settings.base_model_name_or_path)


def _base_copy(key: str, tensor: torch.Tensor, settings: LoraSettings, spec: BaseModelSpec,
               paths: dict[str, tuple[int, str]]) -> bool:
    """PEFT saves the weight of an embedding or LM head it put LoRA on beside the LoRA pair
    (save_embedding_layers, on by default for them), in case training resized the vocabulary. With the base
    model's vocabulary it is the base model's own frozen weight, and is not served; a copy of another shape
    means a resized vocabulary, which the base model here does not have."""
    m = _BASE_COPY.match(key)
    target = paths.get(m["path"]) if m is not None else None
    if target is None or target[0] != TOP_LEVEL or target not in settings.targets:
        return False
    expected = [spec.vocab_size, spec.hidden_size]
    if list(tensor.shape) != expected:
        raise AdapterValidationError(
            f"{_WEIGHTS}: tensor {key!r} has shape {list(tensor.shape)}; it is PEFT's copy of the base model's "
            f"{target[1]} weight, which here is {expected} (vocabulary {spec.vocab_size}, hidden size "
            f"{spec.hidden_size}). An adapter trained with a resized vocabulary (resize_token_embeddings) does not "
            f"fit this base model{_made_for(settings, spec)}", ErrorCode.SHAPE_MISMATCH)
    return True
def _training_only(key: str, settings: LoraSettings, paths: dict[str, tuple[int, str]]) -> bool:
    """A tensor a training-only variant (VeLoRA, MonteCLoRA) saved beside a targeted module's A and B: PEFT's
    inference does not read it."""
    for name in settings.training_only_tensors:
        m = re.match(rf"^{re.escape(_PREFIX)}(?P<path>.+)\.{name}(\..+)?$", key)
        if m is not None and paths.get(m["path"]) in settings.targets:
            return True
    return False


def _module_path(key: str) -> str | None:
    if "lora_magnitude_vector" in key:
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} is a DoRA magnitude vector; DoRA adapters are "
                                     f"not supported yet", ErrorCode.DORA_UNSUPPORTED)
    if "trainable_tokens" in key:
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} holds trainable token embeddings "
                                     f"(trainable_token_indices), which are not supported", ErrorCode.OPTION_UNSUPPORTED)
    if "modules_to_save" in key:
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} is a full copy of a base module "
                                     f"(modules_to_save), which is not supported", ErrorCode.MODULES_TO_SAVE_UNSUPPORTED)
    if key.endswith(".bias"):
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} is a bias (trained with PEFT's bias='all' or "
                                     f"'lora_only'); adapters that change the base model's biases are not "
                                     f"supported (retrain with bias='none')", ErrorCode.BIAS_UNSUPPORTED)
    m = _KEY.match(key) or _EMBEDDING_KEY.match(key)
    if m is None or not key.startswith(_PREFIX):
        return None
    return m["path"][len(_PREFIX):]


def _made_for(settings: LoraSettings, spec: BaseModelSpec, vocabulary: bool = False) -> str:
    """Where the shapes say the adapter belongs to another model: the model its config names, beside this one."""
    named = settings.base_model_name_or_path
    vocab = f", a vocabulary of {spec.vocab_size} tokens" if vocabulary else ""
    here = f"{spec.architecture} with hidden size {spec.hidden_size}{vocab} and {spec.num_layers} layers"
    if named:
        return f". The adapter was made for {named!r} (base_model_name_or_path); the base model here is {here}"
    return f". The adapter looks made for another base model; the base model here is {here}"


def _checked_pair(a_item, b_item, layer: int, module: str, settings: LoraSettings, spec: BaseModelSpec):
    (a_key, a), (b_key, b) = a_item, b_item
    shape = spec.peft_shape(module)
    path = spec.module_path(layer, module)
    rank = settings.rank_for(path)
    name = where(layer, module)
    made_for = _made_for(settings, spec, vocabulary=layer == TOP_LEVEL)
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterValidationError(f"{_WEIGHTS}: {a_key} has shape {list(a.shape)} and {b_key} "
                                     f"{list(b.shape)}; LoRA A and B must be matrices", ErrorCode.SHAPE_MISMATCH)
    if a.shape[1] != shape.in_features:
        takes = (f"has a vocabulary of {shape.in_features} tokens" if module == _EMBEDDING
                 else f"takes {shape.in_features} input features")
        raise AdapterValidationError(
            f"{_WEIGHTS}: {a_key} has shape {list(a.shape)}; {name} of the base model {takes}, so A must be "
            f"[r, {shape.in_features}]{made_for}", ErrorCode.SHAPE_MISMATCH)
    if b.shape[0] != shape.out_features:
        gives = (f"has a vocabulary of {shape.out_features} tokens" if module == "lm_head"
                 else f"gives {shape.out_features} output features")
        raise AdapterValidationError(
            f"{_WEIGHTS}: {b_key} has shape {list(b.shape)}; {name} of the base model {gives}, so B must be "
            f"[{shape.out_features}, r]{made_for}", ErrorCode.SHAPE_MISMATCH)
    if a.shape[0] != b.shape[1]:
        raise AdapterValidationError(f"{_WEIGHTS}: {a_key} has rank {a.shape[0]} but {b_key} has rank {b.shape[1]}",
                                     ErrorCode.RANK_MISMATCH)
    if a.shape[0] != rank:
        raise AdapterValidationError(
            f"{_WEIGHTS}: {name} has rank {a.shape[0]} in its tensors but {rank} in "
            f"adapter_config.json (r / rank_pattern)", ErrorCode.RANK_MISMATCH)
    # A may be a view into the buffer holding the whole PEFT file; a copy lets that buffer go.
    a32 = a.to(torch.float32, copy=True).contiguous()
    b32 = (b.to(torch.float32) * settings.scale_for(path)).contiguous()
    for key, t in ((a_key, a32), (b_key, b32)):
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} has {bad} non-finite values (NaN or inf)"
                                         f"{' after scaling' if t is b32 and torch.isfinite(b).all() else ''}",
                                         ErrorCode.NON_FINITE)
    check_update_bound(a32, b32, f"{_WEIGHTS}: {name}")
    return a32, b32
