"""Console sign-in: a signed, httponly, SameSite=Strict cookie naming a server-side session row.

The cookie carries only a random session id, signed with the service secret; the database keeps the
session's hash, expiry and CSRF token, so logout and expiry hold on every API process at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from loraplex.config import Settings
from loraplex.platform.console.models import ConsoleSession
from loraplex.platform.models import AdminKey, utcnow
from loraplex.platform.security import ADMIN_KEY_PREFIX, hash_key

SESSION_COOKIE = "lpx_console"
LOGIN_COOKIE = "lpx_console_login"  # pre-session CSRF token for the sign-in form itself
SESSION_TTL = timedelta(hours=12)
LOGIN_TTL = timedelta(minutes=30)


@dataclass(frozen=True)
class ConsoleContext:
    session_id: int
    admin_key_id: int
    csrf_token: str


def _serializer(settings: Settings, purpose: str) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(settings.secret_key, salt=f"loraplex.console.{purpose}")


def _sid_hash(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def verify_admin_credential(session: Session, settings: Settings, credential: str) -> AdminKey | None:
    credential = (credential or "").strip()
    if not credential.startswith(ADMIN_KEY_PREFIX):
        return None
    key = session.scalar(select(AdminKey).where(AdminKey.key_hash == hash_key(settings.secret_key, credential)))
    if key is None or key.revoked_at is not None:
        return None
    return key


def is_revoked_admin_credential(session: Session, settings: Settings, credential: str) -> bool:
    """Whether `credential` is an admin key that was valid once and has been revoked."""
    credential = (credential or "").strip()
    if not credential.startswith(ADMIN_KEY_PREFIX):
        return False
    key = session.scalar(select(AdminKey).where(AdminKey.key_hash == hash_key(settings.secret_key, credential)))
    return key is not None and key.revoked_at is not None


def start_session(session: Session, settings: Settings, admin_key: AdminKey) -> str:
    """Create a session row (and clear out dead ones); returns the signed cookie value."""
    now = utcnow()
    session.execute(delete(ConsoleSession).where(
        or_(ConsoleSession.expires_at < now, ConsoleSession.ended_at < now - SESSION_TTL)
    ))
    sid = secrets.token_urlsafe(32)
    session.add(ConsoleSession(
        sid_hash=_sid_hash(sid), csrf_token=secrets.token_urlsafe(32), admin_key_id=admin_key.id,
        expires_at=utcnow() + SESSION_TTL,
    ))
    session.flush()
    return _serializer(settings, "session").dumps(sid)


def _session_row(session: Session, settings: Settings, cookie: str | None) -> ConsoleSession | None:
    if not cookie:
        return None
    try:
        sid = _serializer(settings, "session").loads(cookie, max_age=int(SESSION_TTL.total_seconds()))
    except BadSignature:
        return None
    return session.scalar(select(ConsoleSession).where(ConsoleSession.sid_hash == _sid_hash(str(sid))))


def load_session(session: Session, settings: Settings, cookie: str | None) -> ConsoleContext | None:
    row = _session_row(session, settings, cookie)
    if row is None or row.ended_at is not None or row.expires_at <= utcnow():
        return None
    key = session.get(AdminKey, row.admin_key_id)
    if key is None or key.revoked_at is not None:  # revoking the admin key signs its sessions out
        return None
    return ConsoleContext(session_id=row.id, admin_key_id=row.admin_key_id, csrf_token=row.csrf_token)


def revoked_key_prefix(session: Session, settings: Settings, cookie: str | None) -> str | None:
    """The display prefix of the admin key a signed-out session was made with, where that key has been revoked
    (and the session was not ended by signing out): the operator is told the key was revoked, not that the
    session expired."""
    row = _session_row(session, settings, cookie)
    if row is None or row.ended_at is not None:
        return None
    key = session.get(AdminKey, row.admin_key_id)
    return key.prefix if key is not None and key.revoked_at is not None else None


def end_session(session: Session, session_id: int) -> None:
    session.execute(update(ConsoleSession).where(ConsoleSession.id == session_id).values(ended_at=utcnow()))


def new_login_token(settings: Settings, cookie: str | None = None) -> tuple[str, str]:
    """(token for the form, signed value for the pre-session cookie). A browser that holds a pre-session
    cookie from less than half its lifetime ago keeps its token: sign-in pages open in several tabs (a
    session that expired under them) all stay valid, instead of only the one loaded last."""
    serializer = _serializer(settings, "login")
    if cookie:
        try:
            token = serializer.loads(cookie, max_age=int(LOGIN_TTL.total_seconds() / 2))
        except BadSignature:
            pass
        else:
            if isinstance(token, str):
                return token, cookie
    token = secrets.token_urlsafe(24)
    return token, serializer.dumps(token)


def check_login_token(settings: Settings, cookie: str | None, submitted: str | None) -> bool:
    if not cookie or not submitted:
        return False
    try:
        token = _serializer(settings, "login").loads(cookie, max_age=int(LOGIN_TTL.total_seconds()))
    except BadSignature:
        return False
    return hmac.compare_digest(str(token), submitted)


def csrf_matches(expected: str, submitted: str | None) -> bool:
    return bool(submitted) and hmac.compare_digest(expected, submitted)


def cookie_secure(settings: Settings) -> bool:
    # Browsers drop Secure cookies on plain-http localhost, which is how development runs.
    return settings.environment not in {"development", "test"}
