"""Adapter names to engine requests: `name` (latest ready version) or `name@version` (a content-hash prefix),
always within the caller's tenant."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from sqlalchemy import Engine, bindparam, select
from sqlalchemy.orm import Session

from loraplex.engine.lora_request import LoRARequest
from loraplex.platform.adapter_registry import UPLOAD_UNAVAILABLE
from loraplex.platform.errors import shown
from loraplex.platform.hot_query import HotQuery
from loraplex.platform.models import Adapter, AdapterVersion, VersionStatus
from loraplex.platform.scoping import TenantScope

MIN_VERSION_CHARS = 6


class ModelNotFound(LookupError):
    pass


@dataclass(frozen=True)
class ModelTarget:
    """What a request's `model` resolved to. adapter is None for the base model."""

    model: str
    adapter: LoRARequest | None = None
    adapter_name: str | None = None
    created: int = 0


def store_path(store_dir: Path, content_hash: str) -> str:
    return str(Path(store_dir) / f"{content_hash}.safetensors")


def resolve_model(session: Session, tenant_id: int, model: str, base_model: str,
                  store_dir: Path | None = None) -> ModelTarget:
    if model == base_model:
        return ModelTarget(model=model)
    name, at, version = model.partition("@")
    # "name@" with nothing after it names no version: refused like any too-short one, not read as the latest
    if at and len(version) < MIN_VERSION_CHARS:
        if name == base_model:
            raise ModelNotFound(_base_takes_no_version(model, base_model))
        raise ModelNotFound(f"The model '{shown(model)}' does not exist: give at least {MIN_VERSION_CHARS} "
                            "characters of the version.")
    scope = TenantScope(session, tenant_id)
    # One query on the hot path: the newest ready version(s) of the tenant's adapter of that name.
    stmt = (scope.select(AdapterVersion, AdapterVersion.status == VersionStatus.ready.value)
            .join(Adapter, Adapter.id == AdapterVersion.adapter_id).where(Adapter.name == name)
            .with_only_columns(AdapterVersion.content_hash, AdapterVersion.created_at)
            .order_by(AdapterVersion.id.desc()).limit(2))
    if version:
        stmt = stmt.where(AdapterVersion.content_hash.startswith(version.lower(), autoescape=True))
    found = session.execute(stmt).all()
    if not found:
        adapter = scope.one_or_none(Adapter, Adapter.name == name)
        if adapter is None and name == base_model:
            raise ModelNotFound(_base_takes_no_version(model, base_model))
        if adapter is None:
            raise ModelNotFound(f"The model '{shown(model)}' does not exist or you do not have access to it.")
        # A validation that committed between the two reads (each statement sees what was committed when it
        # began) left a ready version the first one missed: look again rather than say there is none.
        if any(v.status == VersionStatus.ready.value for v in adapter.versions):
            found = session.execute(stmt).all()
        if not found:
            raise ModelNotFound(_not_ready(model, adapter, version))
    if version and len(found) > 1 and found[0].content_hash != found[1].content_hash:
        raise ModelNotFound(f"The version '{shown(version)}' of '{name}' is ambiguous; give more characters.")
    content_hash, created_at = found[0]
    path = store_path(store_dir, content_hash) if store_dir is not None else ""
    return ModelTarget(model=model, adapter=LoRARequest(name=name, content_hash=content_hash, path=path),
                       adapter_name=name, created=int(created_at.timestamp()))


def _base_takes_no_version(model: str, base_model: str) -> str:
    # (`base@version` reaches an adapter only where one is named like the base model)
    return (f"The model '{shown(model)}' does not exist: the base model '{base_model}' has no versions; send "
            f"'{base_model}' alone.")


def _not_ready(model: str, adapter: Adapter, version: str) -> str:
    """Why an adapter of the tenant's serves nothing for `model`: it has no such version (a version is named
    by its content hash, which only a validated upload has), or its newest upload is still being validated
    or was refused."""
    if version:
        return f"The model '{shown(model)}' does not exist: adapter '{adapter.name}' has no version '{shown(version)}'."
    newest = max(adapter.versions, key=lambda v: v.id, default=None)
    if newest is not None and newest.status in (VersionStatus.pending.value, VersionStatus.validating.value):
        return (f"The model '{shown(model)}' is not ready yet: adapter '{adapter.name}' is still being validated; "
                "retry in a few seconds.")
    if newest is not None and newest.error_code == UPLOAD_UNAVAILABLE:
        return (f"The model '{shown(model)}' cannot be served: adapter '{adapter.name}' could not be validated "
                f"({UPLOAD_UNAVAILABLE}: {newest.error}).")
    if newest is not None and newest.status == VersionStatus.failed.value:
        return (f"The model '{shown(model)}' cannot be served: adapter '{adapter.name}' was refused at validation "
                f"({newest.error_code or 'invalid_adapter'}: {shown(newest.error, 300)}); upload a corrected version.")
    return f"The model '{shown(model)}' does not exist: adapter '{adapter.name}' has no ready version."


_LATEST_READY = HotQuery(
    select(AdapterVersion.content_hash, AdapterVersion.created_at)
    .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
    .where(AdapterVersion.tenant_id == bindparam("tenant_id"), Adapter.name == bindparam("name"),
           AdapterVersion.status == VersionStatus.ready.value)
    .order_by(AdapterVersion.id.desc()).limit(1)
)


def resolve_latest_fast(db: Engine, tenant_id: int, model: str, base_model: str, store_dir: Path) -> ModelTarget:
    """resolve_model for the common case (`name`, its newest ready version) as one prepared query;
    anything else, or a miss, takes the full path for its exact answer or error."""
    if model == base_model:
        return ModelTarget(model=model)
    if "@" not in model:
        row = _LATEST_READY.first(db, tenant_id=tenant_id, name=model)
        if row is not None:
            content_hash, created_at = row
            created = created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC)
            return ModelTarget(model=model, adapter=LoRARequest(name=model, content_hash=content_hash,
                                                                path=store_path(store_dir, content_hash)),
                               adapter_name=model, created=int(created.timestamp()))
    with Session(db) as session:
        return resolve_model(session, tenant_id, model, base_model, store_dir)


def list_model_ids(session: Session, tenant_id: int, base_model: str | None = None) -> list[tuple[str, int, str]]:
    """(model id, created, adapter name) for each ready adapter: `name` for the newest version, and
    `name@version` for every ready version (once: the same content uploaded again, as another archive
    say, is another version row with the same version). An adapter named like the base model (stored before
    the base model changed, say) is listed only as `name@version`: its plain name reaches the base model."""
    scope = TenantScope(session, tenant_id)
    stmt = (scope.select(AdapterVersion, AdapterVersion.status == VersionStatus.ready.value)
            .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
            .add_columns(Adapter.name).order_by(Adapter.name, AdapterVersion.id.desc()))
    out: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    for version, name in session.execute(stmt):
        created = int(version.created_at.timestamp())
        for model_id in (name, f"{name}@{version.version}"):
            if model_id not in seen and model_id != base_model:
                seen.add(model_id)
                out.append((model_id, created, name))
    return out


def uploaded_adapter(settings, tenant_ref: str, model: str) -> LoRARequest:
    """A tenant's uploaded adapter (`name` or `name@version`) as a LoRARequest on its store entry, read from
    the server's database (`loraplex generate --tenant T --adapter NAME`). Raises LookupError saying what is
    missing: the database, the tenant, the adapter or its stored weights."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    from loraplex.config import masked_url
    from loraplex.platform.db import make_engine
    from loraplex.platform.tenants import TenantError, get_tenant

    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        raise LookupError(f"no server database at {url.database}; run this where `loraplex serve` runs (or set "
                          "LORAPLEX_DATA_DIR / LORAPLEX_DATABASE_URL)")
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with Session(engine) as session:
            tenant = get_tenant(session, tenant_ref)
            target = resolve_model(session, tenant.id, model, "", settings.resolved_adapter_store_dir.resolve())
    except TenantError as exc:
        raise LookupError(str(exc)) from exc
    except ModelNotFound as exc:
        raise LookupError(f"tenant {tenant_ref!r}: {exc}") from exc
    except OperationalError as exc:
        from loraplex.platform.db_errors import database_error

        raise LookupError(f"cannot read the database {masked_url(settings.resolved_database_url)}: "
                          f"{database_error(exc)}") from exc
    finally:
        engine.dispose()
    if target.adapter is None or not Path(target.adapter.path).is_file():
        raise LookupError(f"adapter {model!r} of tenant {tenant_ref!r} has no entry in the local adapter store "
                          f"({settings.resolved_adapter_store_dir})")
    return target.adapter
