"""Settings for the service: the one place that reads the environment (prefix LORAPLEX_)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SECRET = "dev-insecure-secret-change-me"

# the settings that configure the engine, besides the model (EngineConfig's fields of the same names)
ENGINE_SETTINGS = ("dtype", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_cpu_loras",
                   "max_lora_rank", "lora_dtype", "max_model_len")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", env_file=None, frozen=True, extra="ignore")

    environment: str = "development"  # development | test | production
    secret_key: str = DEFAULT_SECRET  # keys the API-key hash and signs console sessions
    data_dir: Path = Path(".loraplex")
    database_url: str | None = None  # default: sqlite file under data_dir
    redis_url: str | None = None  # when set: Redis quotas, Celery broker, engine registry
    adapter_store_dir: Path | None = None  # default: data_dir / "adapters"

    # engine (embedded)
    model: str = "smollm2-135m"
    model_cache: Path | None = None  # converted/downloaded models; default ~/.cache/loraplex/models
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    kv_cache_memory: int = Field(default=512 * 1024 * 1024, ge=1)  # bytes
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_loras: int = Field(default=8, ge=0)
    max_cpu_loras: int = Field(default=64, ge=0)
    max_lora_rank: int = Field(default=64, ge=1, le=4096)
    lora_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # adapter weights in slots: auto (the model's) | float32 | float16 | bfloat16 (CPU)
    max_model_len: int | None = Field(default=None, ge=1)  # default: the model's own context length

    # request bodies other than uploads (JSON): larger ones get 413 before they are read
    max_request_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # a request body (uploads included) must keep arriving: at most this many seconds between its parts,
    # else 408 and the connection closed (0: no limit)
    request_body_timeout: float = Field(default=60.0, ge=0)
    # uploads
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    max_adapter_members: int = Field(default=64, ge=1)

    # default quotas for new tenants (per plan overrides live in the database)
    # (the range a tenant's or plan's own quota takes)
    default_requests_per_minute: int = Field(default=600, ge=1, le=2**31 - 1)
    default_tokens_per_minute: int = Field(default=200_000, ge=1, le=2**31 - 1)
    default_max_concurrent: int = Field(default=32, ge=1, le=2**31 - 1)
    default_monthly_token_budget: int = Field(default=100_000_000, ge=1, le=2**63 - 1)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    # seconds an idle keep-alive connection stays open; longer than HTTP clients' pool expiry (httpx and the
    # openai client drop idle connections after 5 s), so a client never reuses one the server is closing
    keep_alive_timeout: float = Field(default=75.0, gt=0)
    # seconds a stopping server (SIGTERM, Ctrl-C) lets running requests finish; those still running then are
    # cut off as a client disconnect is (usage recorded for what was generated). A second Ctrl-C stops at once.
    shutdown_timeout: float = Field(default=30.0, ge=0)
    celery_task_always_eager: bool | None = None  # None: eager unless redis_url is set
    engine_queue: str = Field(default="engine", description="Celery queue the engine process consumes")
    task_queue: str = "loraplex"  # Celery queue of the background workers
    redis_prefix: str = "lpx"  # namespace of every Redis key (quotas, usage journal, locks)
    # seconds a Redis connect, and a Redis reply, may take before the command fails (and is retried)
    redis_connect_timeout: float = Field(default=3.0, gt=0)
    redis_socket_timeout: float = Field(default=5.0, gt=0)
    # times a Redis command cut by a dropped connection or a timeout is sent again (exponential backoff from
    # 50 ms, at most 2 s apart): a Redis restart of a few seconds is waited out rather than failing requests
    redis_retries: int = Field(default=6, ge=0)
    # seconds one Redis command may take in all, connecting and every retry included: a Redis that accepts
    # connections but never answers fails the command (a request: 503) this soon, not after retries x timeouts
    redis_deadline: float = Field(default=4.0, gt=0)
    auto_migrate: bool = True  # run `alembic upgrade head` when the API starts
    embedded_engine: bool = True  # build the engine inside the API process (AsyncEngine)
    usage_flush_interval: float = Field(default=1.0, gt=0)  # seconds between batched usage inserts
    usage_batch_size: int = Field(default=500, ge=1)
    upload_wait_seconds: float = Field(default=30.0, ge=0)  # upper bound on `wait=true` uploads waiting for validation
    # seconds the store keeps the weights of a deleted adapter version before a sweep removes them (after
    # checking no version refers to them again): requests that resolved to it and still wait in another
    # process's engine queue load them meanwhile. A single process with in-process tasks (the embedded
    # default) knows its own requests and removes them as soon as none uses them.
    adapter_store_grace_seconds: float = Field(default=600.0, ge=0)
    warm_adapters_interval: float = Field(default=300.0, ge=0)  # seconds between "keep the busiest adapters warm" runs
    # seconds between the runs, in each process that holds an engine, that make the engine's pins match the
    # database's (the first right at start: an engine that restarts gets its pins back at once)
    pin_sync_interval: float = Field(default=60.0, gt=0)
    # when set, GET /metrics needs "Authorization: Bearer <metrics_token>" (Prometheus: `authorization`
    # in the scrape config); unset, /metrics is open and belongs behind the network boundary
    metrics_token: str | None = None

    @field_validator("database_url", "redis_url", mode="before")
    @classmethod
    def _empty_url_is_unset(cls, value):
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("database_url", "redis_url")
    @classmethod
    def _known_url_kind(cls, value: str | None, info: ValidationInfo) -> str | None:
        pattern, expected = _URL_KINDS[info.field_name]
        if value is not None and not pattern.match(value):
            raise ValueError(f"must be {expected}")
        return value

    @model_validator(mode="after")
    def _refuse_insecure_defaults(self) -> Settings:
        if self.environment not in {"development", "test"} and self.secret_key == DEFAULT_SECRET:
            raise ValueError(
                "LORAPLEX_SECRET_KEY must be set to a random secret outside development "
                "(for example: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if self.environment not in {"development", "test"} and len(self.secret_key) < 16:
            raise ValueError("LORAPLEX_SECRET_KEY must be at least 16 characters")
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'loraplex.db').resolve()}"

    @property
    def engine_options(self) -> dict[str, Any]:
        """The engine settings (EngineConfig's fields) every command that runs an engine takes from here:
        `loraplex serve`, `loraplex engine` and `loraplex generate` alike."""
        return {name: getattr(self, name) for name in ENGINE_SETTINGS}

    @property
    def resolved_adapter_store_dir(self) -> Path:
        return self.adapter_store_dir or (self.data_dir / "adapters")

    @property
    def tasks_eager(self) -> bool:
        if self.celery_task_always_eager is not None:
            return self.celery_task_always_eager
        return self.redis_url is None


_URL_KINDS = {
    "database_url": (re.compile(r"^(sqlite|postgres|postgresql)(\+\w+)?://", re.IGNORECASE),
                     "a SQLite (sqlite:///PATH) or PostgreSQL (postgresql://USER@HOST:PORT/DB) URL"),
    "redis_url": (re.compile(r"^(redis|rediss|unix)://", re.IGNORECASE),
                  "a Redis URL: redis://HOST:PORT/DB, rediss://... (TLS) or unix:///PATH"),
}


def masked_url(url: str) -> str:
    """A URL fit for messages and logs: its password, if any, replaced."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


@lru_cache
def get_settings() -> Settings:
    return Settings()
