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
from .spec import BaseModelSpec

_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed_out")
_ALL_LINEAR = "all-linear"
# PiSSA, OLoRA and CorDA subtract their initial A/B from the base weights; LoftQ replaces them with a
# quantized copy. Such adapters are only correct on that modified base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# Options that change what the adapter computes and that canonical A/B weights cannot express.
_UNSUPPORTED_OPTIONS = {
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA",
    "arrow_config": "Arrow routing",
}


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
        raise _invalid("adapter_config.json must be a JSON object")
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
    settings = LoraSettings(
        r=r, lora_alpha=alpha, use_rslora=use_rslora, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        targets=_resolve_targets(config, spec), base_model_name_or_path=base if isinstance(base, str) else None,
    )
    _check_rank_limit(settings, spec, limits)
    return settings


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
                f"adapter_config.json: {where} is {rank} (layer {layer} {module}), over the rank limit of "
                f"{limits.max_rank} (the max_lora_rank setting)", ErrorCode.RANK_TOO_LARGE)


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
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterValidationError(
            f"adapter_config.json: init_lora_weights is {init!r}; that initialisation changes the base model's "
            f"weights, so the adapter only works on that changed model. Convert it to a plain LoRA first (PEFT: "
            f"save_pretrained(..., path_initial_model_for_weight_conversion=...))", ErrorCode.OPTION_UNSUPPORTED)
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise AdapterValidationError(f"adapter_config.json: {key}={config[key]!r}; {what} is not supported",
                                         ErrorCode.OPTION_UNSUPPORTED)


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


def _resolve_targets(config: dict, spec: BaseModelSpec) -> frozenset[tuple[int, str]]:
    target = config.get("target_modules")
    layers = _layers_to_transform(config, spec)
    exclude = config.get("exclude_modules")
    paths = {(i, m): spec.module_path(i, m) for i in range(spec.num_layers) for m in spec.peft_modules}
    exact: set[tuple[int, str]] = set()
    if target == _ALL_LINEAR or target == [_ALL_LINEAR]:
        matched = set(paths)
    elif isinstance(target, str):
        try:
            pattern = re.compile(target)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _invalid(f"target_modules pattern {target!r} is invalid: {exc}") from exc
        if pattern.fullmatch("model.embed_tokens") or pattern.fullmatch("lm_head"):
            raise _embedding(target)
        matched = {k for k, p in paths.items() if pattern.fullmatch(p)}
        if not matched:
            raise _unknown(target, spec)
        layers = None  # as in PEFT: layers_to_transform only narrows a list of target names
    elif isinstance(target, list) and target and all(isinstance(t, str) for t in target):
        matched = set()
        for name in target:
            if name.rsplit(".", 1)[-1] in _EMBEDDING_NAMES:
                raise _embedding(name)
            matched |= {k for k, p in paths.items() if p == name or p.endswith(f".{name}")}
        # As in PEFT, a module named in full is targeted whatever layers_to_transform says; the layer filter
        # narrows only the modules matched by a name's ending.
        exact = {k for k, p in paths.items() if p in target}
        if not matched:
            # As PEFT does, names that match nothing are passed over (training scripts often list the names
            # of several architectures, e.g. q_proj and query_key_value) as long as one name matches.
            raise _unknown(target[0] if len(target) == 1 else target, spec)
    else:
        raise _invalid(f"target_modules must be a non-empty list of module names or a pattern, got {target!r}")
    if exclude:
        if isinstance(exclude, str):
            try:
                exclude = re.compile(exclude)
            except (re.error, RecursionError, OverflowError) as exc:
                raise _invalid(f"exclude_modules pattern {exclude!r} is invalid: {exc}") from exc
        matched = {k for k in matched if not _excluded(exclude, paths[k])}
    if layers is not None:
        matched = {k for k in matched if k[0] in layers or k in exact}
    if not matched:
        raise _invalid("the adapter targets no module of the base model (after exclude_modules and "
                       "layers_to_transform)")
    return frozenset(matched)


def _excluded(exclude: object, path: str) -> bool:
    if isinstance(exclude, re.Pattern):
        return exclude.fullmatch(path) is not None
    if isinstance(exclude, list):
        return any(path == e or path.endswith(f".{e}") for e in exclude)
    raise _invalid(f"exclude_modules must be a list of names or a pattern, got {exclude!r}")


def _layers_to_transform(config: dict, spec: BaseModelSpec) -> set[int] | None:
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    values = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise _invalid(f"layers_to_transform must be an integer or a list of integers, got {layers!r}")
    for v in values:
        if not 0 <= v < spec.num_layers:
            raise AdapterValidationError(
                f"adapter_config.json: layers_to_transform names layer {v}, but the base model has layers "
                f"0..{spec.num_layers - 1}", ErrorCode.LAYER_OUT_OF_RANGE)
    pattern = config.get("layers_pattern")
    container = spec.layer_prefix.rsplit(".", 1)[-1]
    if pattern not in (None, "", [], container, [container]):
        raise AdapterValidationError(
            f"adapter_config.json: layers_pattern {pattern!r} does not name the base model's layers ({container!r})",
            ErrorCode.OPTION_UNSUPPORTED)
    return set(values)


def _invalid(why: str) -> AdapterValidationError:
    return AdapterValidationError(f"adapter_config.json: {why}", ErrorCode.CONFIG_INVALID)


def _embedding(name: str) -> AdapterValidationError:
    return AdapterValidationError(
        f"adapter_config.json: target module {name!r} is an embedding or the LM head; LoRA on embeddings and "
        f"lm_head is not supported", ErrorCode.EMBEDDING_LORA_UNSUPPORTED)


def _unknown(name: str | list[str], spec: BaseModelSpec) -> AdapterValidationError:
    what = f"target module {name!r} is not" if isinstance(name, str) else f"none of the target modules {name!r} is"
    return AdapterValidationError(
        f"adapter_config.json: {what} a projection of {spec.architecture}; known modules: "
        f"{', '.join(spec.peft_modules)}", ErrorCode.UNKNOWN_TARGET_MODULE)
