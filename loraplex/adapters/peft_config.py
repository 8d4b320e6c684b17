"""adapter_config.json: what we accept from PEFT's LoraConfig, and the (layer, module) pairs it targets.

Target matching, layers_to_transform and rank/alpha patterns follow PEFT's own rules
(`check_target_module_exists`, `get_pattern_key`) so we resolve exactly the modules PEFT would wrap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits
from .spec import TOP_LEVEL, BaseModelSpec
from .targets import resolve_targets, ties_lm_head

# PiSSA, OLoRA, CorDA and LoRA-GA subtract their initial A/B from the base weights; LoftQ replaces them with a
# quantized copy. Such adapters are only correct on that modified base, until converted to plain LoRA.
_BASE_CHANGING_INITS = {"pissa": "PiSSA", "olora": "OLoRA", "corda": "CorDA", "lora_ga": "LoRA-GA", "loftq": "LoftQ"}
# Initialisations that only choose the starting A and B (MiCA also freezes B in training): what is saved is plain
# LoRA on the unchanged base, as PEFT loads it.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica")
# Options that change what the adapter computes and that canonical A/B weights cannot express.
_UNSUPPORTED_OPTIONS = {
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA",
}
# LoRA variants PEFT turns on with a sub-config: any value but null turns them on, an empty {} included.
_UNSUPPORTED_VARIANTS = {
    "arrow_config": "Arrow routing",
    "use_bdlora": "BD-LoRA (block-diagonal A or B)",
    "kasa_config": "KaSA, which truncates the base weights' smallest singular components and scales the update "
                   "by a trained diagonal (lora_diag)",
}
# Variants that change only training (VeLoRA's compressed activations, MonteCLoRA's sampled noise): in
# inference PEFT computes plain LoRA, and the extra tensors they save (named here) take no part.
TRAINING_ONLY_VARIANTS = {"velora_config": "lora_velora_embed", "monteclora_config": "lora_monteclora_sampler"}


@dataclass(frozen=True)
class LoraSettings:
    """The parts of a LoraConfig that decide the adapter's effective weights."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    targets: frozenset[tuple[int, str]]  # (layer, PEFT module name)
    base_model_name_or_path: str | None
    # names of per-module tensors saved by a training-only variant, not part of the weights served
    training_only_tensors: tuple[str, ...] = ()
    # ensure_weight_tying on a tied model: the LM head's LoRA is the embedding's, transposed (targets.ties_lm_head)
    tied_lm_head: bool = False

    def rank_for(self, module_path: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module_path), self.r)

    def scale_for(self, module_path: str) -> float:
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_path), self.lora_alpha)
        r = self.rank_for(module_path)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, object], module_path: str) -> str | None:
    for key in patterns:
        if _key_pattern(key).match(module_path):
            return key
    return None


def _key_pattern(key: str) -> re.Pattern:
    """PEFT's reading of a rank_pattern / alpha_pattern key: the key's pattern at the end of a module path."""
    return re.compile(rf"(.*\.)?({key})$")


def parse_lora_config(config: object, spec: BaseModelSpec, limits: AdapterLimits) -> LoraSettings:
    if not isinstance(config, dict):
        raise _invalid(f"must be a JSON object (peft_type, r, target_modules, ...), not {_json_kind(config)}")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterValidationError(
            f"adapter_config.json: peft_type is {peft_type!r}; only LoRA adapters (peft_type 'LORA') are supported",
            ErrorCode.PEFT_TYPE)
    task_type = config.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        raise AdapterValidationError(
            f"adapter_config.json: task_type is {task_type!r}; the base model is a causal LM (task_type "
            f"'CAUSAL_LM')", ErrorCode.TASK_TYPE)
    _refuse_unsupported(config)
    r = _rank(config.get("r", 8), "r")
    alpha = _alpha(config.get("lora_alpha", 8), "lora_alpha")
    rank_pattern = _pattern(config.get("rank_pattern"), "rank_pattern", _rank)
    alpha_pattern = _pattern(config.get("alpha_pattern"), "alpha_pattern", _alpha)
    use_rslora = _flag(config, "use_rslora")
    base = config.get("base_model_name_or_path")
    _flag(config, "ensure_weight_tying")
    targets = resolve_targets(config, spec)
    tied = ties_lm_head(config, spec)
    if tied:
        targets = targets | {(TOP_LEVEL, "embed_tokens"), (TOP_LEVEL, "lm_head")}
    settings = LoraSettings(
        r=r, lora_alpha=alpha, use_rslora=use_rslora, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        targets=targets, base_model_name_or_path=base if isinstance(base, str) else None,
        training_only_tensors=tuple(name for key, name in TRAINING_ONLY_VARIANTS.items()
                                    if config.get(key) is not None),
        tied_lm_head=tied,
    )
    _check_rank_limit(settings, spec, limits)
    return settings


def _json_kind(value: object) -> str:
    kinds = {list: "a list", str: "a string", bool: "true or false", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def place(layer: int, module: str) -> str:
    return module if layer == TOP_LEVEL else f"layer {layer} {module}"


def _check_rank_limit(settings: LoraSettings, spec: BaseModelSpec, limits: AdapterLimits) -> None:
    # The limit applies to the ranks modules really get: a large default r that rank_pattern overrides
    # everywhere costs nothing.
    for layer, module in sorted(settings.targets):
        path = spec.module_path(layer, module)
        key = _pattern_key(settings.rank_pattern, path)
        rank = settings.rank_pattern[key] if key is not None else settings.r
        if rank > limits.max_rank:
            where = f"rank_pattern[{key!r}]" if key is not None else "r"
            raise AdapterValidationError(
                f"adapter_config.json: {where} is {rank} ({place(layer, module)}), over the rank limit of "
                f"{limits.max_rank} ({limits.max_rank_from})", ErrorCode.RANK_TOO_LARGE)


def _refuse_unsupported(config: dict) -> None:
    if _flag(config, "use_dora"):
        raise AdapterValidationError(
            "adapter_config.json: use_dora is true; DoRA adapters are not supported yet (retrain with "
            "use_dora=False)", ErrorCode.DORA_UNSUPPORTED)
    if config.get("modules_to_save"):
        raise AdapterValidationError(
            f"adapter_config.json: modules_to_save={config['modules_to_save']!r}; adapters that save full copies "
            f"of base modules are not supported (only LoRA A/B weights are served)",
            ErrorCode.MODULES_TO_SAVE_UNSUPPORTED)
    # bias "all" or "lora_only" trains the base model's own biases; on a model whose projections have none
    # (Llama, Mistral) the file holds none and the adapter is plain LoRA, as PEFT loads it. Bias tensors
    # that are there are refused where the weights are read.
    bias = config.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise AdapterValidationError(
            f"adapter_config.json: bias is {bias!r}; PEFT's values are 'none', 'all' and 'lora_only'",
            ErrorCode.CONFIG_INVALID)
    if _flag(config, "lora_bias"):
        raise AdapterValidationError("adapter_config.json: lora_bias is true; a bias on lora_B is not supported",
                                     ErrorCode.BIAS_UNSUPPORTED)
    _check_init(config.get("init_lora_weights"))
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise AdapterValidationError(f"adapter_config.json: {key}={config[key]!r}; {what} is not supported",
                                         ErrorCode.OPTION_UNSUPPORTED)
    for key, what in _UNSUPPORTED_VARIANTS.items():
        if config.get(key) is not None:
            raise AdapterValidationError(f"adapter_config.json: {key}={config[key]!r}; {what} is not supported "
                                         f"(only plain LoRA weights are served)", ErrorCode.OPTION_UNSUPPORTED)
    for key in TRAINING_ONLY_VARIANTS:
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise _invalid(f"{key} must be an object or null, got {config[key]!r}")
    # PEFT runs one variant per module; two at once is a combination it refuses.
    variants = [key for key in TRAINING_ONLY_VARIANTS if config.get(key) is not None]
    if config.get("init_lora_weights") == "mica":
        variants.append("init_lora_weights='mica'")
    if len(variants) > 1:
        raise AdapterValidationError(f"adapter_config.json: {' and '.join(variants)} are LoRA variants PEFT does "
                                     f"not combine", ErrorCode.OPTION_UNSUPPORTED)


def _check_init(init: object) -> None:
    if init is None or isinstance(init, bool):
        return  # True (PEFT's default), False, or null (read as False): plain LoRA
    if not isinstance(init, str):
        raise _invalid(f"init_lora_weights must be true, false or the name of an initialisation, got {init!r}")
    for prefix, name in _BASE_CHANGING_INITS.items():
        if init.lower().startswith(prefix):
            raise AdapterValidationError(
                f"adapter_config.json: init_lora_weights is {init!r}; {name} initialisation changes the base model's "
                f"weights, so the adapter only works on that changed model. Convert it to a plain LoRA first (PEFT: "
                f"save_pretrained(..., path_initial_model_for_weight_conversion=...))", ErrorCode.OPTION_UNSUPPORTED)
    if init.lower() not in _PLAIN_INITS:
        raise _invalid(f"init_lora_weights is {init!r}, which is not an initialisation PEFT knows (true, false, "
                       f"{', '.join(repr(i) for i in (*_PLAIN_INITS, *_BASE_CHANGING_INITS))})")


def _flag(config: dict, key: str) -> bool:
    """A true/false option: left out or null is false (as PEFT reads it); anything but a JSON boolean is
    refused rather than guessed at (PEFT would take the string "false" as true)."""
    value = config.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(f"{key} must be true or false, got {value!r}")
    return value


def _rank(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterValidationError(f"adapter_config.json: {where} must be a positive integer, got {value!r}",
                                     ErrorCode.INVALID_RANK)
    return value


def _alpha(value: object, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise AdapterValidationError(f"adapter_config.json: {where} must be a positive finite number, got {value!r}",
                                     ErrorCode.INVALID_ALPHA)
    return float(value)


def _pattern(value: object, name: str, check) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(f"{name} must be an object mapping module patterns to values, got {value!r}")
    out = {}
    for key, item in value.items():
        try:
            _key_pattern(key)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _invalid(f"{name} key {key!r} is not a valid pattern: {exc}") from exc
        out[key] = check(item, f"{name}[{key!r}]")
    return out


def _invalid(why: str) -> AdapterValidationError:
    return AdapterValidationError(f"adapter_config.json: {why}", ErrorCode.CONFIG_INVALID)
