"""The console's router: pages, their JSON helpers and the static assets, all under /console."""

from __future__ import annotations

import mimetypes

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse

from loraplex.platform.console import (
    adapter_pages,
    admin_keys,
    auth_routes,
    dashboard,
    playground,
    tenant_pages,
    tenant_search,
    usage_pages,
)
from loraplex.platform.console.session import SESSION_COOKIE, ConsoleContext, load_session
from loraplex.platform.console.templating import WEB_DIR, render
from loraplex.platform.errors import answer_errors_in_html
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute, prefix="/console", include_in_schema=False)
STATIC_DIR = (WEB_DIR / "static").resolve()


@router.get("")
@router.get("/")
def console_home() -> RedirectResponse:
    return RedirectResponse("/console/dashboard", status_code=303)


@router.get("/static/{path:path}")
def static_asset(path: str) -> FileResponse:
    target = (STATIC_DIR / path).resolve()
    if not target.is_relative_to(STATIC_DIR) or not target.is_file():
        raise HTTPException(404, "no such asset")
    media_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    return FileResponse(target, media_type=media_type, headers={
        "cache-control": "no-cache", "x-content-type-options": "nosniff",
    })


def _signed_in(request: Request) -> ConsoleContext | None:
    """The page's session, if any: an error page of a signed-in operator keeps a working sign-out form."""
    try:
        services = request.app.state.services
        with services.sessions() as session:
            return load_session(session, services.settings, request.cookies.get(SESSION_COOKIE))
    except Exception:  # the error may be the database's own: the page still renders, without the form's token
        return None


def _error_page(request: Request, status: int, message: str) -> HTMLResponse:
    """The error as a page: with the console's menu for a signed-in operator, and without it (a link to sign
    in instead) for anyone else, such as a sign-in form refused for its CSRF token."""
    titles = {400: "Not a valid request", 401: "Sign in needed", 403: "Not allowed", 404: "Not found",
              405: "Not allowed here", 413: "Too large"}
    context = _signed_in(request)
    return render(request, "error.html", context, status_code=status, signed_in=context is not None,
                  title=titles.get(status, "Something went wrong" if status >= 500 else "Not a valid request"),
                  message=message)


# The console's pages answer errors (an id that is not a number, a page that does not exist) as pages; its
# JSON helpers under /console/api answer in JSON, like the API.
answer_errors_in_html("/console", _error_page, json_under=("/console/api/",))

PAGE_MODULES = (auth_routes, dashboard, tenant_pages, tenant_search, adapter_pages, usage_pages, playground,
                admin_keys)
for module in PAGE_MODULES:
    router.include_router(module.router)
