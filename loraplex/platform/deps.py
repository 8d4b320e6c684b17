"""Dependencies, declared once as Annotated aliases. Routes never check tenancy or scopes by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Annotated

from annotated_types import Interval
from fastapi import Depends, Header, Path, Query, Request
from sqlalchemy.orm import Session

from loraplex.platform.auth import (
    AdminContext,
    TenantContext,
    authenticate_admin,
    authenticate_tenant_fast,
    require_scope,
)
from loraplex.platform.errors import bad_request
from loraplex.platform.models import MAX_ROW_ID, Scope
from loraplex.platform.paging import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    PageParams,
    PagingError,
    page_params,
    parse_id_cursor,
    parse_name_cursor,
)
from loraplex.platform.scoping import TenantScope
from loraplex.platform.security import bearer_token
from loraplex.platform.services import Services


async def get_services(request: Request) -> Services:
    # async: a plain function would cost a threadpool hop on every request
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    with services.sessions() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


# scope="function": the commit happens before the response is sent, so a client that gets its answer can
# rely on the change (a revoked key is refused by its very next request).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

AuthorizationHeader = Annotated[str | None, Header(alias="authorization", include_in_schema=False)]


async def get_tenant(request: Request) -> TenantContext:
    # Reads the request rather than declaring sub-dependencies (services, the header), which FastAPI would
    # resolve again on every API call. Its own short connection: an inference stream must not hold one
    # open. A local SQLite lookup by an indexed hash takes tens of microseconds, less than a hop to the
    # threadpool (and its GIL handoff) would; a networked database is queried off the event loop.
    services: Services = request.app.state.services
    token = bearer_token(request.headers.get("authorization"))
    if services.db.dialect.name == "sqlite":
        tenant = authenticate_tenant_fast(services.db, services.settings, token)
    else:
        tenant = await asyncio.to_thread(authenticate_tenant_fast, services.db, services.settings, token)
    if services.key_use is not None:
        services.key_use.touch(tenant.key_id)  # written in the background, once a minute
    return tenant


TenantDep = Annotated[TenantContext, Depends(get_tenant)]


def scoped(scope: Scope):
    async def dependency(tenant: TenantDep) -> TenantContext:
        return require_scope(tenant, scope.value)

    dependency.__name__ = f"require_{scope.value}_scope"
    return dependency


InferenceKeyDep = Annotated[TenantContext, Depends(scoped(Scope.inference))]
AdaptersKeyDep = Annotated[TenantContext, Depends(scoped(Scope.adapters))]
UsageKeyDep = Annotated[TenantContext, Depends(scoped(Scope.usage))]


def get_tenant_scope(tenant: TenantDep, session: SessionDep) -> TenantScope:
    return TenantScope(session, tenant.tenant_id)


TenantScopeDep = Annotated[TenantScope, Depends(get_tenant_scope)]


def get_admin(services: ServicesDep, authorization: AuthorizationHeader = None) -> AdminContext:
    with services.sessions() as session:
        return authenticate_admin(session, services.settings, bearer_token(authorization))


AdminDep = Annotated[AdminContext, Depends(get_admin)]

# Row ids in paths and queries: an out-of-range number is a 400 naming the parameter, not a database
# overflow (a 500) later.
RowId = Annotated[int, Interval(ge=1, le=MAX_ROW_ID)]
IdPath = Annotated[RowId, Path()]


# Paging parameters: declared here so they appear in the OpenAPI schema, read as text so that a bad value is a
# 400 naming the parameter with the accepted range.
_LIMIT = Query(description=f"rows per page, 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})")
_AFTER = Query(description="the `last_id` of the previous page: the page of rows after it")
_BEFORE = Query(description="the `first_id` of the next page: the page of rows before it")
_SEARCH = Query(description="case-insensitive substring of the name (% and _ match themselves)")


def _page_dependency(cursor):
    def dependency(request: Request, limit: Annotated[str | None, _LIMIT] = None,
                   after: Annotated[str | None, _AFTER] = None, before: Annotated[str | None, _BEFORE] = None,
                   q: Annotated[str | None, _SEARCH] = None) -> PageParams:
        try:
            return page_params(request.query_params, cursor)
        except PagingError as exc:
            raise bad_request(str(exc), param=exc.param) from exc

    return dependency


PageDep = Annotated[PageParams, Depends(_page_dependency(parse_id_cursor))]
NamePageDep = Annotated[PageParams, Depends(_page_dependency(parse_name_cursor))]


def _query_names(route) -> frozenset[str]:
    """The query parameters a route takes, its dependencies' included; worked out once per route."""
    known = getattr(route, "_loraplex_query_names", None)
    if known is None:
        known = route._loraplex_query_names = _collect_query_names(route.dependant)
    return known


def _collect_query_names(dependant) -> frozenset[str]:
    names, pending = set(), [dependant]
    while pending:
        dependant = pending.pop()
        names.update(p.alias for p in dependant.query_params)
        pending.extend(dependant.dependencies)
    return frozenset(names)


async def refuse_unknown_query(request: Request) -> None:
    """A report's filters are query parameters: one it does not take (misspelt, or a path segment sent as a
    query, as `?period=` for `/statements/{period}`) would be ignored and answer another question than the one
    asked, so it is refused by name. Declared after the caller's authentication, which it does not precede."""
    route = request.scope.get("route")
    if getattr(route, "dependant", None) is None:
        return
    known = _query_names(route)
    unknown = next((name for name in request.query_params if name not in known), None)
    if unknown is not None:
        takes = ", ".join(sorted(known)) if known else "no query parameters"
        raise bad_request(f"unknown query parameter {unknown!r}: {route.path} takes {takes}", param=unknown)


KnownQueryDep = Annotated[None, Depends(refuse_unknown_query)]
