"""Fixtures for the control plane: a migrated SQLite database per test, an app with a fake or real
engine, the admin key, and factories for tenants and keys."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from platform_helpers import TenantKey, make_settings

from loraplex.config import Settings


@pytest.fixture(scope="session")
def migrated_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Migrations run once per session; each test gets a copy of the result."""
    from loraplex.platform.migrate import upgrade_to_head

    path = tmp_path_factory.mktemp("dbtemplate") / "template.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture
def data_dir(tmp_path: Path, migrated_sqlite_template: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(migrated_sqlite_template, d / "loraplex.db")
    return d


@pytest.fixture
def settings(data_dir: Path, tiny_llama_dir: Path) -> Settings:
    # the fake engine serves "fake-base"; uploads are validated against the tiny model's shapes
    return make_settings(data_dir, model=str(tiny_llama_dir))


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(settings: Settings, fake_engine: FakeEngine):
    from loraplex.platform.app import create_app

    return create_app(settings, engine=fake_engine)


@pytest.fixture
def client(app) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def admin_key(app, client) -> str:
    from loraplex.platform.db import session_scope
    from loraplex.platform.tenants import create_admin_key

    with session_scope(app.state.services.sessions) as session:
        _, secret = create_admin_key(session, app.state.services.settings)
    return secret


@pytest.fixture
def make_tenant(app, client) -> Callable[..., TenantKey]:
    """Create a tenant (with quota overrides) and one key, directly in the database."""
    from loraplex.platform.db import session_scope
    from loraplex.platform.schemas.tenants import KeyCreate, TenantCreate
    from loraplex.platform.tenants import create_api_key, create_tenant

    counter = iter(range(1, 10_000))

    def make(name: str | None = None, *, scopes: list[str] | None = None, **quotas) -> TenantKey:
        services = app.state.services
        with session_scope(services.sessions) as session:
            tenant = create_tenant(session, TenantCreate(name=name or f"tenant{next(counter)}", **quotas))
            key_data = KeyCreate(scopes=scopes) if scopes is not None else KeyCreate()
            created = create_api_key(session, services.settings, tenant, key_data)
            return TenantKey(tenant.id, tenant.name, created.id, created.key)

    return make


@pytest.fixture(scope="session")
def peft_adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplex.testing import make_peft_adapter

    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("peft"), r=4,
                             target_modules=("q_proj", "v_proj"), seed=7)


@pytest.fixture(scope="session")
def peft_adapter_zip(peft_adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import zipfile

    path = tmp_path_factory.mktemp("peftzip") / "adapter.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(peft_adapter_dir.iterdir()):
            if f.is_file():
                zf.write(f, f"my-adapter/{f.name}")
    return path


@pytest.fixture
def make_tenant_factory(migrated_sqlite_template):
    """(app, make_tenant) for tests that run their own server with their own settings and engine."""
    from loraplex.platform.app import create_app
    from loraplex.platform.db import session_scope
    from loraplex.platform.schemas.tenants import KeyCreate, TenantCreate
    from loraplex.platform.tenants import create_api_key, create_tenant

    def build(settings: Settings, engine, limiter=None):
        app = create_app(settings, engine=engine, limiter=limiter)
        counter = iter(range(1, 10_000))

        def make(**quotas) -> TenantKey:
            services = app.state.services
            with session_scope(services.sessions) as session:
                tenant = create_tenant(session, TenantCreate(name=f"live{next(counter)}", **quotas))
                created = create_api_key(session, services.settings, tenant, KeyCreate())
                return TenantKey(tenant.id, tenant.name, created.id, created.key)

        return app, make

    return build


@pytest.fixture
def elsewhere(monkeypatch, tmp_path):
    """A command run as a new user would: no LORAPLEX_ settings, in a fresh folder."""
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path
