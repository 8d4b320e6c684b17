"""Helpers shared by the control-plane tests (a uniquely named module, importable from any test)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.config import Settings

TEST_SECRET = "test-secret-0123456789abcdef"


def make_settings(data_dir: Path, **overrides) -> Settings:
    values = dict(environment="test", secret_key=TEST_SECRET, data_dir=data_dir, warm_adapters_interval=0,
                  database_url=f"sqlite:///{data_dir / 'loraplex.db'}", auto_migrate=False,
                  embedded_engine=False, redis_url=None, usage_flush_interval=0.05)
    values.update(overrides)
    return Settings(**values)


@dataclass
class TenantKey:
    tenant_id: int
    tenant_name: str
    key_id: int
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def upload(client, tenant: TenantKey, name: str, files: list[tuple[str, bytes]], *, wait: bool = True):
    """POST /v1/adapters with the given (filename, content) pairs."""
    return client.post("/v1/adapters", params={"wait": str(wait).lower()}, headers=tenant.headers,
                       data={"name": name}, files=[("file", (fn, content)) for fn, content in files])
