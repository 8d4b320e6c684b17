"""Admin keys: who can use /admin/api and this console, and revoking one (as GET and DELETE
/admin/api/admin-keys). New admin keys come from `loraplex admin create-admin-key` only: a secret is never
minted from a browser session."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import func, select

from loraplex.platform.console.deps import ConsoleDep, ConsolePostDep
from loraplex.platform.console.paging import back_to, page_of
from loraplex.platform.console.templating import redirect, render
from loraplex.platform.deps import IdPath, ServicesDep
from loraplex.platform.models import AdminKey
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import TenantError, revoke_admin_key

router = APIRouter(route_class=StrictJsonRoute)


@router.get("/admin-keys", response_class=HTMLResponse)
def admin_keys_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    with services.sessions() as session:
        keys, pager = page_of(request, session, select(AdminKey), AdminKey.id, lambda k: k.id,
                              search_columns=(AdminKey.name, AdminKey.prefix))
        # over every key, not the page: revoking the last active one is warned about wherever it is listed
        active = session.scalar(select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None)))
        session.expunge_all()
    return render(request, "admin_keys.html", context, keys=keys, active=active, own_key_id=context.admin_key_id,
                  pager=pager)


@router.post("/admin-keys/{key_id}/revoke")
async def admin_key_revoke(request: Request, context: ConsolePostDep, services: ServicesDep,
                           key_id: IdPath) -> RedirectResponse:
    back = back_to(request, "/console/admin-keys")
    try:
        with services.sessions() as session:
            key = revoke_admin_key(session, key_id)
            session.commit()
            prefix = key.prefix
    except TenantError as exc:
        return redirect(request, back, error=f"Nothing revoked: {exc}.")
    # revoking the key this session was signed in with ends it: the next page asks to sign in, saying why
    return redirect(request, back, flash=f"Admin key {prefix}… revoked: it is refused from now on.")
