"""Jinja2 rendering for console pages, with the security headers every page carries."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse
from itsdangerous import BadSignature, URLSafeTimedSerializer
from jinja2 import Environment, FileSystemLoader, select_autoescape

from loraplex.platform.billing.money import format_micros
from loraplex.platform.console.session import ConsoleContext
from loraplex.resources import resource_dir

WEB_DIR = resource_dir("web")

SECURITY_HEADERS = {
    # no inline script or style anywhere in the console, so the policy can be strict
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _money(amount: int | None, places: int = 2) -> str:
    return "–" if amount is None else format_micros(amount, places=places)


def _number(value: int | float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC") if value else "–"


@lru_cache
def environment() -> Environment:
    if not (WEB_DIR / "templates").is_dir():
        raise RuntimeError(f"console templates not found under {WEB_DIR}; reinstall loraplex or run from a source checkout")
    env = Environment(loader=FileSystemLoader(WEB_DIR / "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(money=_money, number=_number, when=_when)
    return env


def _flash_signer(request: Request) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(request.app.state.settings.secret_key, salt="loraplex.console.flash")


def redirect(request: Request, url: str, *, flash: str | None = None, error: str | None = None) -> RedirectResponse:
    """Post/redirect/get; the message rides along signed, so nobody can put words in the console's mouth."""
    if flash or error:
        signed = _flash_signer(request).dumps({"ok": flash, "error": error})
        url += ("&" if "?" in url else "?") + "msg=" + signed
    return RedirectResponse(url, status_code=303)


def _flash(request: Request) -> dict:
    raw = request.query_params.get("msg")
    if not raw:
        return {}
    try:
        return _flash_signer(request).loads(raw, max_age=120)
    except BadSignature:
        return {}


def render(
    request: Request, template: str, context: ConsoleContext | None, status_code: int = 200, **values: Any
) -> HTMLResponse:
    page = environment().get_template(template).render(
        request=request, csrf_token=context.csrf_token if context else "", path=request.url.path,
        flash=_flash(request), **values,
    )
    return HTMLResponse(page, status_code=status_code, headers=SECURITY_HEADERS)
