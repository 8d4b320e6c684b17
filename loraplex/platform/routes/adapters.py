"""/v1/adapters: upload (multipart, streamed under a size limit), list, read, delete; an adapter's versions."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import selectinload

from loraplex.platform.adapter_registry import (
    TERMINAL,
    UPLOAD_UNAVAILABLE,
    UPLOAD_UNAVAILABLE_MESSAGE,
    adapter_public,
    delete_adapter,
    delete_version,
    get_adapter,
    register_upload,
    uploads_root,
)
from loraplex.platform.db import session_scope
from loraplex.platform.deps import AdaptersKeyDep, NamePageDep, ServicesDep, TenantScopeDep
from loraplex.platform.errors import APIError, bad_request, conflict, not_found, shown
from loraplex.platform.ids import parse_row_id
from loraplex.platform.models import Adapter, AdapterVersion, VersionStatus
from loraplex.platform.paging import fetch_page, matching
from loraplex.platform.schemas.adapters import (
    AdapterDeleted,
    AdapterList,
    AdapterPublic,
    AdapterVersionDeleted,
    AdapterVersionList,
    AdapterVersionPublic,
)
from loraplex.platform.scoping import TenantScope
from loraplex.platform.services import Services
from loraplex.platform.strict_json import StrictJsonRoute, refuse_encoded_body
from loraplex.platform.uploads import parse_upload, too_large

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJsonRoute, prefix="/v1/adapters", tags=["adapters"])
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers on top of the file bytes


@router.post("", response_model=None, status_code=201, responses={202: {"model": AdapterVersionPublic}})
async def upload_adapter(*, tenant: AdaptersKeyDep, services: ServicesDep, request: Request,
                         wait: bool = Query(default=False, description="wait for validation to finish")
                         ) -> JSONResponse:
    return await handle_upload(services, tenant.tenant_id, request, wait)


async def handle_upload(services: Services, tenant_id: int, request: Request, wait: bool) -> JSONResponse:
    """Upload for one tenant: 201 ready, 202 still validating, 422 refused (with wait), 413 too large, 500 when
    the validation could not read the staged files (with wait)."""
    refuse_encoded_body(request.headers)
    limit = services.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise too_large(limit)
    staging = uploads_root(services.settings) / f"incoming-{uuid.uuid4().hex}"
    upload = await parse_upload(request.stream(), request.headers.get("content-type", ""), staging, limit)
    try:
        version_id, created, _ = await asyncio.to_thread(register_with_retry, services, tenant_id, upload)
    except BaseException:
        upload.discard()
        raise
    if created or await asyncio.to_thread(_still_pending, services, version_id):
        # (sent again for the same upload of a version still pending: its first task may have been lost)
        try:
            await services.tasks.send_async("loraplex.validate_adapter", version_id)
        except Exception as exc:  # the task queue is unreachable: the upload is kept, pending
            log.warning("adapter version %s is stored but its validation could not be queued (%s); the "
                        "worker's sweep of pending versions will validate it", version_id, exc)
    version = await _wait_for(services, version_id, services.settings.upload_wait_seconds if wait else 0.0)
    if version.status == VersionStatus.failed.value:
        if wait:
            await asyncio.to_thread(_forget_failed, services, version_id)
        if version.error_code == UPLOAD_UNAVAILABLE:  # the server lost the files: not the adapter's fault
            # the cause is in the log of the worker that validated it, under the version's id: this log line
            # ties the request id the tenant quotes to that version
            request_id = request.scope.get("state", {}).get("request_id", "-")
            log.error("request %s: adapter version %s could not be validated: the worker could not read its "
                      "staged upload (the worker's log names the path it looked for)", request_id, version_id)
            raise APIError(500, f"The adapter could not be validated (request {request_id}): "
                                f"{UPLOAD_UNAVAILABLE_MESSAGE}.", type="server_error", code=UPLOAD_UNAVAILABLE)
        raise APIError(422, f"The adapter was refused: {version.error}", param="file",
                       code=version.error_code or "invalid_adapter")
    status = 201 if version.status == VersionStatus.ready.value else 202
    return JSONResponse(version.model_dump(mode="json"), status_code=status)


def register_with_retry(services: Services, tenant_id: int, upload) -> tuple[int, bool, str]:
    """register_upload in its own transaction: (version id, created, adapter name). Every upload route uses
    it, so all of them survive the race below."""
    for attempt in range(2):
        try:
            with session_scope(services.sessions) as session:
                version, created = register_upload(session, TenantScope(session, tenant_id), services.settings,
                                                   upload, services.base_model_name)
                return version.id, created, version.adapter.name
        except IntegrityError:
            # two first uploads of one name raced to create the adapter; the second now finds it
            if attempt:
                raise
    raise AssertionError("unreachable")


def _still_pending(services: Services, version_id: int) -> bool:
    """Whether the same upload again should send its validation again: still pending (its task may have
    been lost), or validating for longer than a validation takes (its worker died)."""
    from datetime import UTC, datetime, timedelta

    from loraplex.platform.recovery import STUCK_VALIDATION_SECONDS

    with services.sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:
            return False
        created = version.created_at if version.created_at.tzinfo else version.created_at.replace(tzinfo=UTC)
        stuck = datetime.now(UTC) - created > timedelta(seconds=STUCK_VALIDATION_SECONDS)
        return version.status == VersionStatus.pending.value or (
            version.status == VersionStatus.validating.value and stuck)


async def _wait_for(services: Services, version_id: int, timeout: float) -> AdapterVersionPublic:
    deadline = time.monotonic() + timeout
    while True:
        version = await asyncio.to_thread(_read_version, services, version_id)
        if version.status in TERMINAL or time.monotonic() >= deadline:
            return version
        await asyncio.sleep(0.05)


def _read_version(services: Services, version_id: int) -> AdapterVersionPublic:
    with services.sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:  # the adapter was deleted (another request) while this upload waited
            raise not_found("The adapter was deleted while this upload was being validated.", param="name",
                            code="adapter_not_found")
        return AdapterVersionPublic.model_validate(version)


def _forget_failed(services: Services, version_id: int) -> None:
    """A synchronous refusal leaves nothing behind: the caller has the reason in the response."""
    with session_scope(services.sessions) as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:
            return
        adapter = version.adapter
        session.delete(version)
        session.flush()
        if not adapter.versions:
            session.delete(adapter)


@router.get("", response_model=AdapterList)
def list_adapters(*, _tenant: AdaptersKeyDep, scope: TenantScopeDep, page: NamePageDep) -> AdapterList:
    """One page of the caller's adapters, ordered by id (the name): `after`/`before` take the `last_id`/`first_id`
    of a previous page; `q` matches the name."""
    stmt = scope.select(Adapter).options(selectinload(Adapter.versions))
    if page.search:
        stmt = stmt.where(matching(page.search, Adapter.name))
    adapters, has_more = fetch_page(scope.session, stmt, Adapter.name, page)
    data = [adapter_public(a) for a in adapters]
    return AdapterList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                       has_more=has_more)


@router.get("/{name}", response_model=AdapterPublic)
def read_adapter(*, _tenant: AdaptersKeyDep, scope: TenantScopeDep, name: str) -> AdapterPublic:
    return adapter_public(get_adapter(scope, name))


@router.delete("/{name}", response_model=AdapterDeleted)
async def remove_adapter(*, tenant: AdaptersKeyDep, services: ServicesDep, name: str) -> AdapterDeleted:
    return await handle_delete(services, tenant.tenant_id, name)


# a version's `version` (what follows '@' in its model name): 12 hex digits, never read as an id (ids have at
# most 10 digits)
_VERSION = re.compile(r"[0-9a-f]{12}")


def version_ref(text: str) -> int | str:
    """A version as a path names it: its `id` or its `version`."""
    if _VERSION.fullmatch(text):
        return text
    row_id = parse_row_id(text)
    if row_id is None:
        raise bad_request(f"'{shown(text)}' names no version: give a version's id (a number, as in its 'id') or "
                          "its version (the 12 hex digits after '@' in its model name)", param="version_id")
    return row_id


def find_version(adapter: Adapter, ref: int | str, *, one: bool = False) -> AdapterVersion:
    """The version a path names. Several rows may hold one `version` (the same weights uploaded again in
    another archive, or an older version's files uploaded again as a rollback): by `version` this is the
    newest of them, or with `one` (a delete) a 409 naming their ids unless there is just one."""
    key = "id" if isinstance(ref, int) else "version"
    matches = sorted((v for v in adapter.versions if getattr(v, key) == ref), key=lambda v: v.id)
    if not matches:
        raise not_found(f"Adapter '{adapter.name}' has no version with {key} {ref}.", param="version_id",
                        code="version_not_found")
    if one and len(matches) > 1:
        ids = ", ".join(str(v.id) for v in matches)
        raise conflict(f"Adapter '{adapter.name}' has {len(matches)} versions with version {ref} (the same weights "
                       f"uploaded more than once; ids {ids}): name the one to delete by its id.", param="version_id")
    return matches[-1]


@router.get("/{name}/versions", response_model=AdapterVersionList)
def list_versions(*, _tenant: AdaptersKeyDep, scope: TenantScopeDep, name: str) -> AdapterVersionList:
    return AdapterVersionList(data=adapter_public(get_adapter(scope, name)).versions)


@router.get("/{name}/versions/{version_id}", response_model=AdapterVersionPublic)
def read_version(*, _tenant: AdaptersKeyDep, scope: TenantScopeDep, name: str,
                 version_id: str) -> AdapterVersionPublic:
    """One version, by its `id` or its `version`."""
    return AdapterVersionPublic.model_validate(find_version(get_adapter(scope, name), version_ref(version_id)))


@router.delete("/{name}/versions/{version_id}", response_model=AdapterVersionDeleted)
async def remove_adapter_version(*, tenant: AdaptersKeyDep, services: ServicesDep, name: str,
                                 version_id: str) -> AdapterVersionDeleted:
    """One version (by its `id`, as listed under the adapter's `versions`, or its `version`): a failed upload,
    or a version no longer wanted. The last version takes the adapter with it."""
    return await handle_version_delete(services, tenant.tenant_id, name, version_ref(version_id))


async def handle_version_delete(services: Services, tenant_id: int, name: str,
                                ref: int | str) -> AdapterVersionDeleted:
    def delete() -> tuple[list[str], bool, str, int]:
        with session_scope(services.sessions) as session:
            adapter = get_adapter(TenantScope(session, tenant_id), name)
            version = find_version(adapter, ref, one=True)
            version_id = version.id
            orphaned, adapter_gone = delete_version(session, services.settings, version)
            return orphaned, adapter_gone, adapter.name, version_id

    orphaned, adapter_gone, adapter_name, version_id = await asyncio.to_thread(delete)
    await drop_versions(services, orphaned)
    return AdapterVersionDeleted(id=version_id, adapter=adapter_name, adapter_deleted=adapter_gone)


async def handle_delete(services: Services, tenant_id: int, name: str) -> AdapterDeleted:
    def delete() -> list[str]:
        with session_scope(services.sessions) as session:
            scope = TenantScope(session, tenant_id)
            return delete_adapter(session, services.settings, get_adapter(scope, name))

    orphaned = await asyncio.to_thread(delete)
    await drop_versions(services, orphaned)
    return AdapterDeleted(id=name)


async def drop_versions(services: Services, content_hashes: list[str]) -> None:
    """Out of the engine at once (this process's; other engine processes get a task), and retired in the
    store: requests accepted before the delete may still wait to load the weights, so the entry goes once
    none does (store_sweep). Content another tenant still uses, whose last pin went with the deleted
    adapter, is unpinned."""
    from loraplex.platform.store_sweep import retire

    for version_id in getattr(content_hashes, "unpin", ()):
        await unpin_version_content(services, version_id)
    if content_hashes:
        await asyncio.to_thread(retire, services.store_dir, list(content_hashes))
    for content_hash in content_hashes:
        if services.engine is not None:
            await services.engine.remove_adapter(content_hash)
        if not services.tasks.eager:
            await services.tasks.send_async("loraplex.remove_adapter", content_hash)
    await services.sweep_retired(list(content_hashes))


async def unpin_version_content(services: Services, version_id: int) -> None:
    """Let the engines evict a version's content again (its pin went with another tenant's adapter)."""
    from loraplex.platform.tasks.context import TaskContext
    from loraplex.platform.tasks.jobs import lora_request_for

    if services.engine is not None:
        try:
            lora = await asyncio.to_thread(lora_request_for, TaskContext(services.settings, services.sessions),
                                           version_id)
            if lora is not None:
                await services.engine.prefetch_adapter(lora, pin=False)
        except Exception:
            log.warning("could not unpin adapter version %s's content", version_id, exc_info=True)
    if not services.tasks.eager:
        await services.tasks.send_async("loraplex.prefetch_adapter", version_id, False)
