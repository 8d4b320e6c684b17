"""The (layer, module) pairs an adapter_config.json targets, resolved by PEFT's own rules.

PEFT (`LoraConfig.__post_init__`, `check_target_module_exists`, `_maybe_include_all_linear_layers`) decides which
modules it wraps; an adapter is served on exactly those, or refused where PEFT would refuse the config.
"""

from __future__ import annotations

import re

from .errors import AdapterValidationError, ErrorCode
from .spec import TOP_LEVEL, TOP_MODULES, BaseModelSpec

_ALL_LINEAR = "all-linear"
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the architectures served: what a config without
# target_modules targets. Phi-3 has no entry there, so PEFT asks for target_modules.
_PEFT_DEFAULT_TARGETS = {
    "LlamaForCausalLM": ["q_proj", "v_proj"],
    "MistralForCausalLM": ["q_proj", "v_proj"],
    "Qwen2ForCausalLM": ["q_proj", "v_proj"],
    "Qwen3ForCausalLM": ["q_proj", "v_proj"],
    "GemmaForCausalLM": ["q_proj", "v_proj"],
    "Gemma2ForCausalLM": ["q_proj", "v_proj"],
}
_REGEX_ERRORS = (re.error, RecursionError, OverflowError)
# norms inside a decoder layer beyond the Llama family's two: modules PEFT finds by name but refuses to wrap
_EXTRA_NORMS = {"Qwen3ForCausalLM": (".self_attn.q_norm", ".self_attn.k_norm")}


def resolve_targets(config: dict, spec: BaseModelSpec) -> frozenset[tuple[int, str]]:
    target = config.get("target_modules")
    if target is None:
        target = _default_targets(spec)
    layers = _layers_to_transform(config, target, spec)
    exclude = _exclude(config.get("exclude_modules"))
    projections = {(i, m): spec.module_path(i, m) for i in range(spec.num_layers) for m in spec.peft_modules}
    # LoRA on the input embedding and the LM head, where a name or pattern targets them
    paths = {**projections, **{(TOP_LEVEL, m): spec.module_path(TOP_LEVEL, m) for m in TOP_MODULES}}
    if isinstance(target, str) and target.lower() == _ALL_LINEAR:
        matched = set(projections)  # PEFT's all-linear leaves the output layer (lm_head) out
    elif isinstance(target, str):
        pattern = _compile("target_modules pattern", target)
        _refuse_other_modules(spec, exclude, lambda p: pattern.fullmatch(p) is not None, target)
        matched = {k for k, p in paths.items() if pattern.fullmatch(p)}
        if not matched:
            raise _unknown(target, spec)
    elif isinstance(target, list) and target and all(isinstance(t, str) for t in target):
        named = {k for k, p in paths.items() if _named(target, p)}
        if not named:
            # As PEFT does, names that match nothing are passed over (training scripts often list the names
            # of several architectures, e.g. q_proj and query_key_value) as long as one name matches.
            hint = " (the 'all-linear' shorthand is a string, not a list entry)" if _ALL_LINEAR in target else ""
            raise _unknown(target[0] if len(target) == 1 else target, spec, hint)
        pattern = config.get("layers_pattern")
        _refuse_other_modules(spec, exclude, lambda p: _named(target, p) and _in_layers(target, p, layers, pattern),
                              target)
        matched = {k for k in named if _in_layers(target, paths[k], layers, pattern)}
    else:
        raise _invalid(f"target_modules must be a non-empty list of module names or a pattern, got {target!r}")
    if exclude is not None:
        matched = {k for k in matched if not _excluded(exclude, paths[k])}
    top = sorted(m for layer, m in matched if layer == TOP_LEVEL)
    if top and spec.vocab_size <= 0:
        raise AdapterValidationError(
            f"adapter_config.json: the adapter puts LoRA on {' and '.join(top)}, but the base model's config gives "
            f"no vocab_size to check its weights against", ErrorCode.EMBEDDING_LORA_UNSUPPORTED)
    if not matched:
        raise _invalid("the adapter targets no module of the base model (after exclude_modules and "
                       "layers_to_transform / layers_pattern)")
    return frozenset(matched)


def _named(target: list[str], path: str) -> bool:
    return path in target or any(path.endswith(f".{name}") for name in target)


def _exclude(exclude) -> re.Pattern | list[str] | None:
    if not exclude:
        return None
    if isinstance(exclude, str):
        return _compile("exclude_modules pattern", exclude)
    if not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise _invalid(f"exclude_modules must be a list of names or a pattern, got {exclude!r}")
    return exclude


def _refuse_other_modules(spec: BaseModelSpec, exclude, targeted, target) -> None:
    """PEFT refuses a config that targets a module it cannot wrap ("Target module LlamaAttention(...) is not
    supported"): a decoder layer, an attention or MLP block, a norm. Those of the Llama family are known here."""
    prefix = spec.layer_prefix
    top = prefix.rsplit(".", 1)[0]
    per_layer = ("", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm",
                 *_EXTRA_NORMS.get(spec.architecture, ()))
    others = [top, prefix, f"{top}.norm", *(f"{prefix}.{i}{s}" for i in range(spec.num_layers) for s in per_layer)]
    for path in others:
        if targeted(path) and not (exclude is not None and _excluded(exclude, path)):
            raise AdapterValidationError(
                f"adapter_config.json: target_modules {target!r} targets {path}, which is not a linear layer; PEFT "
                f"refuses to wrap it. LoRA targets the projections: {', '.join(spec.peft_modules)}",
                ErrorCode.UNKNOWN_TARGET_MODULE)


def _default_targets(spec: BaseModelSpec) -> list[str]:
    default = _PEFT_DEFAULT_TARGETS.get(spec.architecture)
    if default is None:
        raise _invalid(f"target_modules is missing, and PEFT has no default target modules for "
                       f"{spec.architecture}; name them (e.g. {', '.join(spec.peft_modules)})")
    return default


def _in_layers(target: list[str], path: str, layers: int | list[int] | None, layers_pattern) -> bool:
    """PEFT's layer filter for a module a list of names matched: one named in full is targeted whatever
    layers_to_transform says; one matched by a name's ending only in the layers listed, its layer index read
    as PEFT reads it."""
    if layers is None or path in target:
        return True
    index = _layer_index(path, layers_pattern)
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def _layer_index(path: str, layers_pattern) -> int | None:
    # PEFT matches the first numbered segment (lazily), after one of layers_pattern's patterns if given.
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if match is not None:
                break
    return int(match["idx"]) if match else None


def _layers_to_transform(config: dict, target, spec: BaseModelSpec) -> int | list[int] | None:
    """layers_to_transform as PEFT uses it (None when it filters nothing), after the checks PEFT's LoraConfig
    makes of it with target_modules and layers_pattern."""
    layers = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if isinstance(target, str) and layers is not None:
        raise _invalid(f"layers_to_transform cannot be used when target_modules is a pattern ({target!r}); PEFT "
                       f"refuses this combination. List the module names instead")
    if isinstance(target, str) and pattern is not None:
        raise _invalid(f"layers_pattern cannot be used when target_modules is a pattern ({target!r}); PEFT "
                       f"refuses this combination")
    if pattern and layers is None:
        raise _invalid("layers_pattern is given without layers_to_transform; PEFT requires both")
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
    _check_layers_pattern(pattern, spec)
    return layers


def _check_layers_pattern(pattern, spec: BaseModelSpec) -> None:
    if not pattern:
        return
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise _invalid(f"layers_pattern must be a name or a list of names, got {pattern!r}")
    for p in patterns:
        _compile("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", shown=p)
    if _layer_index(spec.module_path(0, next(iter(spec.peft_modules))), pattern) is None:
        raise AdapterValidationError(
            f"adapter_config.json: layers_pattern {pattern!r} does not name the base model's layers "
            f"({spec.layer_prefix}.<n>, e.g. {spec.layer_prefix.rsplit('.', 1)[-1]!r})", ErrorCode.OPTION_UNSUPPORTED)


def _excluded(exclude: re.Pattern | list[str], path: str) -> bool:
    if isinstance(exclude, re.Pattern):
        return exclude.fullmatch(path) is not None
    return any(path == e or path.endswith(f".{e}") for e in exclude)


def _compile(what: str, pattern: str, shown: str | None = None) -> re.Pattern:
    try:
        return re.compile(pattern)
    except _REGEX_ERRORS as exc:
        raise _invalid(f"{what} {shown if shown is not None else pattern!r} is invalid: {exc}") from exc


def _invalid(why: str) -> AdapterValidationError:
    return AdapterValidationError(f"adapter_config.json: {why}", ErrorCode.CONFIG_INVALID)


def _unknown(name: str | list[str], spec: BaseModelSpec, hint: str = "") -> AdapterValidationError:
    what = f"target module {name!r} is not" if isinstance(name, str) else f"none of the target modules {name!r} is"
    return AdapterValidationError(
        f"adapter_config.json: {what} a projection of {spec.architecture}; known modules: "
        f"{', '.join((*spec.peft_modules, *TOP_MODULES))}{hint}", ErrorCode.UNKNOWN_TARGET_MODULE)


def ties_lm_head(config: dict, spec: BaseModelSpec) -> bool:
    """PEFT's ensure_weight_tying on a model whose LM head shares the input embedding's weight: where the
    target modules name the embedding or the head, PEFT puts LoRA on the embedding and ties the head's LoRA to
    it (the head's A is the embedding's B transposed, its B the embedding's A transposed), so the two stay one
    matrix. The saved config lists the embedding; a head's LoRA tensors in the file are copies of the tied pair."""
    if config.get("ensure_weight_tying") is not True or not spec.tie_word_embeddings or spec.vocab_size <= 0:
        return False
    target = config.get("target_modules")
    if isinstance(target, str):
        if target.lower() == _ALL_LINEAR:
            return False
        try:
            return any(re.fullmatch(target, m) for m in TOP_MODULES)
        except _REGEX_ERRORS:
            return False
    return isinstance(target, list) and any(isinstance(t, str) and t.split(".")[-1] in TOP_MODULES for t in target)
