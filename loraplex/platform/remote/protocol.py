"""The wire format between API and engine processes: JSON for requests, NDJSON for output streams."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import asdict, fields
from typing import Any

from loraplex.engine.client import EngineStats
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from loraplex.engine.sampling_params import SamplingParams

SECRET_HEADER = "x-loraplex-engine-token"
_PARAM_FIELDS = [f.name for f in fields(SamplingParams) if f.init]


def engine_token(secret_key: str) -> str:
    """Only processes that share the service secret may drive an engine."""
    return hmac.new(secret_key.encode(), b"loraplex-engine", hashlib.sha256).hexdigest()


def secret_fingerprint(secret_key: str) -> str:
    """What an engine's registration shows of its secret: enough for an API process to tell that the two
    were started with different LORAPLEX_SECRET_KEYs (every request would be refused), nothing to drive it."""
    return hashlib.sha256(engine_token(secret_key).encode()).hexdigest()[:16]


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: v for k, v in data.items() if k in _PARAM_FIELDS})


def adapter_to_json(adapter: LoRARequest | None) -> dict[str, str] | None:
    return None if adapter is None else {"name": adapter.name, "content_hash": adapter.content_hash,
                                         "path": adapter.path}


def adapter_from_json(data: dict[str, str] | None) -> LoRARequest | None:
    return None if data is None else LoRARequest(**data)


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return asdict(out)


def _logprobs(items) -> list[TokenLogprobs] | None:
    if items is None:
        return None
    return [TokenLogprobs(chosen=Logprob(**i["chosen"]), top=[Logprob(**t) for t in i["top"]]) for i in items]


def output_from_json(data: dict[str, Any]) -> RequestOutput:
    outputs = []
    for o in data["outputs"]:
        o = dict(o)
        o["logprobs"] = _logprobs(o.get("logprobs"))
        o["delta_logprobs"] = _logprobs(o.get("delta_logprobs"))
        outputs.append(CompletionOutput(**o))
    metrics = RequestMetrics(**data["metrics"]) if data.get("metrics") else None
    return RequestOutput(request_id=data["request_id"], prompt=data.get("prompt"),
                         prompt_token_ids=data["prompt_token_ids"], outputs=outputs, finished=data["finished"],
                         metrics=metrics, error=data.get("error"),
                         error_kind=data.get("error_kind"),
                         num_prompt_tokens_processed=data.get("num_prompt_tokens_processed", 0))


def stats_to_json(stats: EngineStats) -> dict[str, Any]:
    """An engine's stats for its registration record: the numbers and adapter lists, and its pinned adapters
    (the only part of `extra` other processes use)."""
    out = {k: v for k, v in asdict(stats).items() if k != "extra"}
    out["lora_pinned"] = list(stats.extra.get("lora_pinned", ()))
    return out


def add_stats(total: EngineStats, data: dict[str, Any]) -> None:
    """Add one engine's `stats_to_json` into `total`: numbers summed, adapter lists joined."""
    for f in fields(EngineStats):
        value = data.get(f.name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int) and isinstance(getattr(total, f.name), int):
            setattr(total, f.name, getattr(total, f.name) + value)
        elif isinstance(value, list) and isinstance(getattr(total, f.name), list):
            getattr(total, f.name).extend(str(v) for v in value)
    pinned = data.get("lora_pinned")
    if isinstance(pinned, list):
        total.extra.setdefault("lora_pinned", []).extend(str(v) for v in pinned)
