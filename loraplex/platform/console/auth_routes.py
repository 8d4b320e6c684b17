"""Sign-in and sign-out."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from loraplex.platform.console.deps import CSRF_FIELD, ConsolePostDep, same_origin
from loraplex.platform.console.session import (
    LOGIN_COOKIE,
    LOGIN_TTL,
    SESSION_COOKIE,
    SESSION_TTL,
    check_login_token,
    cookie_secure,
    end_session,
    load_session,
    new_login_token,
    start_session,
    verify_admin_credential,
)
from loraplex.platform.console.templating import SECURITY_HEADERS, environment
from loraplex.platform.deps import ServicesDep
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)


def _safe_next(target: str | None) -> str:
    # only paths inside the console: an open redirect would turn sign-in into a phishing aid
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/dashboard"


def _login_page(request: Request, services, *, error: str | None = None, status_code: int = 200,
                next_url: str = "") -> HTMLResponse:
    token, signed = new_login_token(services.settings, request.cookies.get(LOGIN_COOKIE))
    page = environment().get_template("login.html").render(login_token=token, error=error, next=next_url)
    response = HTMLResponse(page, status_code=status_code, headers=SECURITY_HEADERS)
    response.set_cookie(LOGIN_COOKIE, signed, max_age=int(LOGIN_TTL.total_seconds()), httponly=True,
                        samesite="strict", secure=cookie_secure(services.settings), path="/console")
    return response


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, services: ServicesDep, next: str = "") -> HTMLResponse:
    with services.sessions() as session:
        if load_session(session, services.settings, request.cookies.get(SESSION_COOKIE)) is not None:
            return RedirectResponse(_safe_next(next), status_code=303)
    return _login_page(request, services, next_url=_safe_next(next) if next else "")


@router.post("/login")
async def login(request: Request, services: ServicesDep):
    form = await request.form()
    if not same_origin(request) or not check_login_token(
        services.settings, request.cookies.get(LOGIN_COOKIE), form.get(CSRF_FIELD)
    ):
        raise HTTPException(403, "Missing or invalid CSRF token; reload the sign-in page and try again.")
    credential = str(form.get("credential") or "")
    with services.sessions() as session:
        key = verify_admin_credential(session, services.settings, credential)
        if key is None:
            return _login_page(request, services, error="That is not a valid admin key.", status_code=401,
                               next_url=str(form.get("next") or ""))
        cookie = start_session(session, services.settings, key)
        session.commit()
    response = RedirectResponse(_safe_next(str(form.get("next") or "")), status_code=303)
    response.set_cookie(SESSION_COOKIE, cookie, max_age=int(SESSION_TTL.total_seconds()), httponly=True,
                        samesite="strict", secure=cookie_secure(services.settings), path="/console")
    response.delete_cookie(LOGIN_COOKIE, path="/console")
    return response


@router.post("/logout")
def logout(context: ConsolePostDep, services: ServicesDep) -> RedirectResponse:
    with services.sessions() as session:
        end_session(session, context.session_id)
        session.commit()
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/console")
    return response
