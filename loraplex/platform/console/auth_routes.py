"""Sign-in and sign-out."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from loraplex.platform.console.deps import (
    CSRF_FIELD,
    SIGN_IN_REASONS,
    UNSAVED_REASONS,
    ConsolePostDep,
    same_origin,
)
from loraplex.platform.console.session import (
    LOGIN_COOKIE,
    LOGIN_TTL,
    SESSION_COOKIE,
    SESSION_TTL,
    check_login_token,
    cookie_secure,
    end_session,
    is_revoked_admin_credential,
    load_session,
    new_login_token,
    start_session,
    verify_admin_credential,
)
from loraplex.platform.console.templating import FLASH_COOKIE, SECURITY_HEADERS, environment, redirect
from loraplex.platform.deps import ServicesDep
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)

UNSAVED_AFTER_SIGN_IN = "The change you submitted before signing in was not saved; make it again."


def _safe_next(target: str | None) -> str:
    # only paths inside the console: an open redirect would turn sign-in into a phishing aid
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/dashboard"


def _reason(value: object) -> str:
    """A known reason for being sent to sign in, or none: the page never shows words taken from the URL."""
    return value if isinstance(value, str) and value in SIGN_IN_REASONS else ""


def _login_page(request: Request, services, *, error: str | None = None, status_code: int = 200,
                next_url: str = "", reason: str = "") -> HTMLResponse:
    token, signed = new_login_token(services.settings, request.cookies.get(LOGIN_COOKIE))
    page = environment().get_template("login.html").render(
        login_token=token, error=error, next=next_url, reason=reason, notice=SIGN_IN_REASONS.get(reason),
    )
    response = HTMLResponse(page, status_code=status_code, headers=SECURITY_HEADERS)
    response.set_cookie(LOGIN_COOKIE, signed, max_age=int(LOGIN_TTL.total_seconds()), httponly=True,
                        samesite="strict", secure=cookie_secure(services.settings), path="/console")
    return response


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, services: ServicesDep, next: str = "", reason: str = "") -> HTMLResponse:
    with services.sessions() as session:
        if load_session(session, services.settings, request.cookies.get(SESSION_COOKIE)) is not None:
            return RedirectResponse(_safe_next(next), status_code=303)
    return _login_page(request, services, next_url=_safe_next(next) if next else "", reason=_reason(reason))


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
            error = ("That admin key has been revoked; sign in with another one."
                     if is_revoked_admin_credential(session, services.settings, credential)
                     else "That is not a valid admin key.")
            return _login_page(request, services, error=error, status_code=401,
                               next_url=str(form.get("next") or ""), reason=_reason(form.get("reason")))
        cookie = start_session(session, services.settings, key)
        session.commit()
    target = _safe_next(str(form.get("next") or ""))
    # back on the page whose form was refused, which shows the stored values: say again that the change is not
    # among them
    unsaved = UNSAVED_AFTER_SIGN_IN if _reason(form.get("reason")) in UNSAVED_REASONS else None
    response = redirect(request, target, error=unsaved)
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
    response.delete_cookie(FLASH_COOKIE, path="/console")
    return response
