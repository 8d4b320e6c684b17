"""Choosing a tenant by typing its name: a few matches at a time, never the whole list of tenants.

Pages offer a text field with a datalist of at most TENANT_MATCHES names; the console's script refills the
datalist as the operator types, from /console/api/tenants (the admin API's `q` and `limit`, for a signed-in
session). Without the script the field is still a plain text field that takes a tenant's name."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, HTTPException, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.console.deps import ConsoleDep
from loraplex.platform.deps import ServicesDep
from loraplex.platform.models import Tenant
from loraplex.platform.paging import (
    PagingError,
    fetch_page,
    make_page,
    matching,
    page_params,
    parse_name_cursor,
)
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)

TENANT_MATCHES = 20


def tenant_matches(session: Session, text: str | None, limit: int = TENANT_MATCHES) -> list[Tenant]:
    """Up to `limit` tenants whose name holds `text` (case-insensitively), by name; the first ones without text."""
    stmt = select(Tenant)
    if text:
        stmt = stmt.where(matching(text, Tenant.name))
    return list(session.scalars(stmt.order_by(Tenant.name).limit(limit)))


@dataclass(frozen=True)
class TenantChoice:
    tenant: Tenant | None
    typed: str  # what the field shows
    error: str | None = None
    matches: tuple[Tenant, ...] = ()  # for a name that names no tenant: the tenants it could have meant


def choose_tenant(session: Session, typed: str | None) -> TenantChoice:
    """The tenant a typed name names: exactly, else the only one whose name holds it; otherwise a message and
    the matches to pick from."""
    text = (typed or "").strip()
    if len(text) > 200 or not text.isprintable():
        return TenantChoice(None, "", "A tenant's name is printable text of at most 200 characters.")
    exact = session.scalar(select(Tenant).where(Tenant.name == text))
    if exact is not None:
        return TenantChoice(exact, exact.name)
    found = tenant_matches(session, text, TENANT_MATCHES + 1)
    if len(found) == 1:
        return TenantChoice(found[0], found[0].name)
    if not found:
        return TenantChoice(None, text, f"No tenant's name holds {text!r}.")
    more = " (the first ones)" if len(found) > TENANT_MATCHES else ""
    return TenantChoice(None, text, f"Several tenants' names hold {text!r}; pick one{more}.",
                        tuple(found[:TENANT_MATCHES]))


@router.get("/api/tenants")
def search_tenants(request: Request, _context: ConsoleDep, services: ServicesDep):
    """Tenants by name, a page at a time: `q` (part of the name), `limit`, `after` (the last name shown)."""
    try:
        params = page_params(request.query_params, parse_name_cursor)
    except PagingError as exc:
        raise HTTPException(400, str(exc)) from exc
    stmt = select(Tenant)
    if params.search:
        stmt = stmt.where(matching(params.search, Tenant.name))
    with services.sessions() as session:
        rows, has_more = fetch_page(session, stmt, Tenant.name, params)
        return make_page([{"id": t.id, "name": t.name} for t in rows], has_more, lambda item: item["name"])
