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
from loraplex.platform.console.session import ConsoleContext, cookie_secure
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


FLASH_COOKIE = "lpx_console_flash"
FLASH_TTL_SECONDS = 120
# Browsers keep cookies of up to 4096 bytes (name and attributes included): a message whose refused form would
# not fit goes without the form's values
FLASH_COOKIE_CHARS = 3500


def _flash_signer(request: Request) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(request.app.state.settings.secret_key, salt="loraplex.console.flash")


# The longest value a refused form brings back of each of its fields: more than any valid value holds, little
# enough that the message stays within what a cookie holds.
KEPT_VALUE_CHARS = 200


def redirect(request: Request, url: str, *, flash: str | None = None, error: str | None = None,
             kept: tuple[str, Any] | None = None) -> RedirectResponse:
    """Post/redirect/get; the message rides along in a signed, short-lived cookie that the next page shown
    consumes: a reload or a copied link does not show it again, and nobody can put words in the console's mouth.

    `kept` is a refused form's id (its `id` in the page) and the form data it sent: the page shown after the
    refusal fills that form in again with what the user typed, not with the stored values."""
    response = RedirectResponse(url, status_code=303)
    if flash or error:
        message: dict[str, Any] = {"ok": flash, "error": error}
        signer = _flash_signer(request)
        signed = signer.dumps(message)
        if error and kept is not None:
            form_id, form = kept
            values: dict[str, list[str]] = {}
            for name in dict.fromkeys(form.keys()):
                typed = [v for v in form.getlist(name) if isinstance(v, str)]
                # a value longer than any valid one is not brought back (cut short, it would be one the user
                # never typed): its field shows what it would show anyway
                if name != "csrf_token" and all(len(v) <= KEPT_VALUE_CHARS for v in typed):
                    values[name] = typed
            with_form = signer.dumps({**message, "form": {"id": form_id, "values": values}})
            if len(with_form) <= FLASH_COOKIE_CHARS:
                signed = with_form
        response.set_cookie(FLASH_COOKIE, signed, max_age=FLASH_TTL_SECONDS, httponly=True, samesite="strict",
                            secure=cookie_secure(request.app.state.settings), path="/console")
    return response


class KeptForm:
    """What the user typed into a form the server refused, for the page to show again (`typed`), or, for
    another form, the value the page would show anyway (`default`)."""

    def __init__(self, flash: dict):
        kept = flash.get("form") if isinstance(flash.get("form"), dict) else {}
        self.form_id = kept.get("id")
        self.values = kept.get("values") if isinstance(kept.get("values"), dict) else {}

    def value(self, form_id: str, field: str, default: Any = "") -> Any:
        if form_id != self.form_id:
            return default
        values = self.values.get(field) or [""]  # absent: sent empty (an empty select, no checkbox)
        return values[0]

    def all(self, form_id: str, field: str, default: list) -> list:
        return list(self.values.get(field) or []) if form_id == self.form_id else default


def _flash(request: Request) -> dict:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return {}
    try:
        message = _flash_signer(request).loads(raw, max_age=FLASH_TTL_SECONDS)
    except BadSignature:
        return {}
    return message if isinstance(message, dict) else {}


def render(
    request: Request, template: str, context: ConsoleContext | None, status_code: int = 200, **values: Any
) -> HTMLResponse:
    flash = _flash(request)
    page = environment().get_template(template).render(
        request=request, csrf_token=context.csrf_token if context else "", path=request.url.path,
        flash=flash, typed=KeptForm(flash), **values,
    )
    response = HTMLResponse(page, status_code=status_code, headers=SECURITY_HEADERS)
    if FLASH_COOKIE in request.cookies:  # shown once: consumed by the page that showed it (or dropped, if stale)
        response.delete_cookie(FLASH_COOKIE, path="/console", httponly=True, samesite="strict",
                               secure=cookie_secure(request.app.state.settings))
    return response
