"""Console dependencies: a signed-in session for every page, plus a CSRF token for every state change."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import Depends, HTTPException, Request

from loraplex.platform.console.session import (
    SESSION_COOKIE,
    ConsoleContext,
    csrf_matches,
    load_session,
    revoked_key_prefix,
)
from loraplex.platform.deps import ServicesDep

CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"


def _page_after_sign_in(request: Request) -> str | None:
    """Where a browser without a session goes back to once signed in: the page it asked for, or for a form
    it posted (its session expired while the page was open) the page the form was on. None for the
    console's JSON API, which answers 401."""
    if "/console/api/" in request.url.path:
        return None
    if request.method == "GET":
        return request.url.path + (f"?{request.url.query}" if request.url.query else "")
    referer = urlsplit(request.headers.get("referer") or "")
    if referer.netloc == request.headers.get("host", "") and referer.path.startswith("/console/"):
        return referer.path + (f"?{referer.query}" if referer.query else "")
    return "/console/tenants"


# Why a browser was sent to sign in, named in the sign-in page's `reason` (the page shows only these words)
SIGN_IN_REASONS = {
    "expired": "Your session has expired; sign in again to continue.",
    "unsaved": "Your session has expired, so the change you submitted was not saved. "
               "Sign in, then make it again.",
    "revoked": "The admin key this session was signed in with has been revoked; sign in with another admin key "
               "to continue.",
    "revoked_unsaved": "The admin key this session was signed in with has been revoked, so the change you "
                       "submitted was not saved. Sign in with another admin key, then make it again.",
}
# the reasons whose post lost a change, which the page after signing in says again
UNSAVED_REASONS = ("unsaved", "revoked_unsaved")


def _sign_in_reason(request: Request, revoked: bool) -> str | None:
    """A refused post lost the operator's change: say so. A page asked for with a session cookie that no longer
    names a session: the session expired (or ended elsewhere), or its admin key was revoked. A first visit,
    with no cookie, needs no notice."""
    if request.method != "GET":
        return "revoked_unsaved" if revoked else "unsaved"
    if revoked:
        return "revoked"
    return "expired" if request.cookies.get(SESSION_COOKIE) else None


def get_console(request: Request, services: ServicesDep) -> ConsoleContext:
    cookie = request.cookies.get(SESSION_COOKIE)
    with services.sessions() as session:
        context = load_session(session, services.settings, cookie)
        revoked = None if context is not None else revoked_key_prefix(session, services.settings, cookie)
    if context is None:
        target = _page_after_sign_in(request)
        if target is not None:  # nothing a signed-out post asked for is done: it is sent to sign in
            reason = _sign_in_reason(request, revoked is not None)
            location = f"/console/login?next={quote(target)}" + (f"&reason={reason}" if reason else "")
            raise HTTPException(303, "sign in first", headers={"Location": location})
        if revoked is not None:
            raise HTTPException(401, f"The admin key {revoked}... this session was signed in with has been "
                                     "revoked; sign in with another admin key.")
        raise HTTPException(401, "Sign in to the console first.")
    return context


ConsoleDep = Annotated[ConsoleContext, Depends(get_console)]


def same_origin(request: Request) -> bool:
    """A browser names the page that sent a post; refuse posts sent from another site's page."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return origin is None  # "null" comes from sandboxed or privacy-stripped contexts: refuse it
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc == host


async def get_console_post(request: Request, context: ConsoleDep) -> ConsoleContext:
    if not same_origin(request):
        raise HTTPException(403, "Cross-site request refused.")
    token = request.headers.get(CSRF_HEADER)
    content_type = request.headers.get("content-type", "")
    # Only plain forms are parsed here: a multipart body (an upload) must bring the header, so that it is
    # refused before a single byte is spooled and the upload handler can still stream it under its limit.
    if token is None and content_type.startswith("application/x-www-form-urlencoded"):
        form = await request.form()  # Starlette caches it: the route reads the same parsed form
        value = form.get(CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not csrf_matches(context.csrf_token, token):
        raise HTTPException(403, "Missing or invalid CSRF token; reload the page and try again.")
    return context


ConsolePostDep = Annotated[ConsoleContext, Depends(get_console_post)]
