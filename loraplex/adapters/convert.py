"""PEFT tensors + LoraSettings -> canonical weights, refusing every tensor that does not fit exactly."""

from __future__ import annotations

import re

import torch

from .canonical import CanonicalAdapter, LoraWeights, check_update_bound
from .errors import AdapterValidationError, ErrorCode
from .peft_config import LoraSettings
from .spec import BaseModelSpec

_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


def to_canonical(tensors: dict[str, torch.Tensor], settings: LoraSettings, spec: BaseModelSpec) -> CanonicalAdapter:
    paths = {spec.module_path(i, m): (i, m) for i in range(spec.num_layers) for m in spec.peft_modules}
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        if _training_only(key, settings, paths):
            continue
        path = _module_path(key)
        target = paths.get(path)
        if target is None:
            module = path.rsplit(".", 1)[-1] if path else None
            if module is not None and module not in spec.peft_modules:
                raise AdapterValidationError(
                    f"{_WEIGHTS}: tensor {key!r} adapts {module!r}, which is not a projection of "
                    f"{spec.architecture}; known modules: {', '.join(spec.peft_modules)}",
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
        if target not in settings.targets:
            raise AdapterValidationError(
                f"{_WEIGHTS}: tensor {key!r} is for layer {target[0]} {target[1]}, which adapter_config.json does "
                f"not target (target_modules / layers_to_transform)", ErrorCode.UNKNOWN_TENSOR)
        found.setdefault(target, {})[_KEY.match(key)["ab"]] = (key, tensor)

    weights: dict[tuple[int, str], LoraWeights] = {}
    for layer, module in sorted(settings.targets):
        pair = found.get((layer, module), {})
        for ab in "AB":
            if ab not in pair:
                raise AdapterValidationError(
                    f"{_WEIGHTS}: missing tensor {_PREFIX}{spec.module_path(layer, module)}.lora_{ab}.weight "
                    f"(layer {layer} {module} is targeted but has no lora_{ab})", ErrorCode.MISSING_TENSOR)
        a, b = _checked_pair(pair["A"], pair["B"], layer, module, settings, spec)
        slices = spec.peft_modules[module]
        for s in slices:
            # A fused projection (qkv_proj, gate_up_proj) becomes one pair per logical projection: a copy of
            # A each (entries are saved as unshared tensors), and the rows of B for that projection's slice.
            a_own = a if len(slices) == 1 else a.clone()
            weights[(layer, s.module)] = LoraWeights(a_own, b[s.start:s.stop].contiguous())
    return CanonicalAdapter.build(weights, architecture=spec.architecture, num_layers=spec.num_layers,
                                  base_model_name_or_path=settings.base_model_name_or_path)


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
    if "lora_embedding_" in key or any(f".{n}." in f".{key}" for n in ("embed_tokens", "lm_head")):
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} adapts an embedding or the LM head; LoRA on "
                                     f"embeddings and lm_head is not supported", ErrorCode.EMBEDDING_LORA_UNSUPPORTED)
    if "modules_to_save" in key:
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} is a full copy of a base module "
                                     f"(modules_to_save), which is not supported", ErrorCode.MODULES_TO_SAVE_UNSUPPORTED)
    if key.endswith(".bias"):
        raise AdapterValidationError(f"{_WEIGHTS}: tensor {key!r} is a bias (trained with PEFT's bias='all' or "
                                     f"'lora_only'); adapters that change the base model's biases are not "
                                     f"supported (retrain with bias='none')", ErrorCode.BIAS_UNSUPPORTED)
    m = _KEY.match(key)
    if m is None or not key.startswith(_PREFIX):
        return None
    return m["path"][len(_PREFIX):]


def _made_for(settings: LoraSettings, spec: BaseModelSpec) -> str:
    """Where the shapes say the adapter belongs to another model: the model its config names, beside this one."""
    named = settings.base_model_name_or_path
    here = f"{spec.architecture} with hidden size {spec.hidden_size} and {spec.num_layers} layers"
    if named:
        return f". The adapter was made for {named!r} (base_model_name_or_path); the base model here is {here}"
    return f". The adapter looks made for another base model; the base model here is {here}"


def _checked_pair(a_item, b_item, layer: int, module: str, settings: LoraSettings, spec: BaseModelSpec):
    (a_key, a), (b_key, b) = a_item, b_item
    shape = spec.peft_shape(module)
    path = spec.module_path(layer, module)
    rank = settings.rank_for(path)
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterValidationError(f"{_WEIGHTS}: {a_key} has shape {list(a.shape)} and {b_key} "
                                     f"{list(b.shape)}; LoRA A and B must be matrices", ErrorCode.SHAPE_MISMATCH)
    if a.shape[1] != shape.in_features:
        raise AdapterValidationError(
            f"{_WEIGHTS}: {a_key} has shape {list(a.shape)}; layer {layer} {module} of the base model takes "
            f"{shape.in_features} input features, so A must be [r, {shape.in_features}]{_made_for(settings, spec)}",
            ErrorCode.SHAPE_MISMATCH)
    if b.shape[0] != shape.out_features:
        raise AdapterValidationError(
            f"{_WEIGHTS}: {b_key} has shape {list(b.shape)}; layer {layer} {module} of the base model gives "
            f"{shape.out_features} output features, so B must be [{shape.out_features}, r]{_made_for(settings, spec)}",
            ErrorCode.SHAPE_MISMATCH)
    if a.shape[0] != b.shape[1]:
        raise AdapterValidationError(f"{_WEIGHTS}: {a_key} has rank {a.shape[0]} but {b_key} has rank {b.shape[1]}",
                                     ErrorCode.RANK_MISMATCH)
    if a.shape[0] != rank:
        raise AdapterValidationError(
            f"{_WEIGHTS}: layer {layer} {module} has rank {a.shape[0]} in its tensors but {rank} in "
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
    check_update_bound(a32, b32, f"{_WEIGHTS}: layer {layer} {module}")
    return a32, b32
