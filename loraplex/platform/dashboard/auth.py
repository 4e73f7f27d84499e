"""Dashboard sign-in: an admin API key buys a server-side session (table `admin_sessions`).

The session cookie holds a random token and the table its sha256, so a leaked table signs no one in. A
session ends at sign-out, after SESSION_TTL, or as soon as its admin key is revoked or expires. Every
state-changing form posts the session's CSRF token back (synchronizer token); the sign-in form, before
any session exists, uses a double-submit cookie instead. Cookies: HttpOnly, SameSite=Strict,
Path=/admin, and Secure when the request came over HTTPS.
"""

from __future__ import annotations

import datetime as dt
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Response
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from loraplex.platform.api.deps import SessionDep
from loraplex.platform.models import AdminSession, ApiKey, utcnow
from loraplex.platform.security import hash_key

SESSION_COOKIE = "lpx_session"
LOGIN_CSRF_COOKIE = "lpx_login_csrf"
CSRF_FIELD = "csrf_token"
SESSION_TTL = dt.timedelta(hours=12)
COOKIE_PATH = "/admin"


class SignInRequired(Exception):
    """No valid session: pages redirect to the sign-in form."""


class CsrfRejected(Exception):
    """A form came without the right CSRF token: 403."""


@dataclass(frozen=True)
class SignedIn:
    """The operator behind a request: which admin key signed in, and the token its forms must carry."""

    key_id: int
    key_prefix: str
    csrf_token: str


def start_session(s: Session, key: ApiKey) -> str:
    """A new session for an active admin key; returns the cookie's token (never stored). Commits."""
    now = utcnow()
    s.execute(delete(AdminSession).where(AdminSession.expires_at <= now))
    token = secrets.token_urlsafe(32)
    s.add(AdminSession(token_hash=hash_key(token), api_key_id=key.id, csrf_token=secrets.token_urlsafe(32),
                       created_at=now, expires_at=now + SESSION_TTL))
    key.last_used_at = now
    s.commit()
    return token


def end_session(s: Session, token: str | None) -> None:
    if token:
        s.execute(delete(AdminSession).where(AdminSession.token_hash == hash_key(token)))
        s.commit()


def find_session(s: Session, token: str | None) -> SignedIn | None:
    """The session of a cookie token while both it and its admin key are valid, else None."""
    if not token or len(token) > 128:
        return None
    now = utcnow()
    row = s.execute(select(AdminSession, ApiKey).join(ApiKey, AdminSession.api_key_id == ApiKey.id)
                    .where(AdminSession.token_hash == hash_key(token))).first()
    if row is None:
        return None
    session, key = row
    if session.expires_at <= now or key.role != "admin" or key.revoked_at is not None:
        return None
    if key.expires_at is not None and key.expires_at <= now:
        return None
    return SignedIn(key.id, key.prefix, session.csrf_token)


def get_signed_in(request: Request, s: SessionDep) -> SignedIn:
    signed_in = find_session(s, request.cookies.get(SESSION_COOKIE))
    if signed_in is None:
        raise SignInRequired()
    return signed_in


Operator = Annotated[SignedIn, Depends(get_signed_in)]


def check_csrf(expected: str | None, form) -> None:
    """Refuse a form whose CSRF token does not match `expected` (constant-time)."""
    sent = form.get(CSRF_FIELD)
    if not expected or not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise CsrfRejected()


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int | None) -> None:
    response.set_cookie(name, value, max_age=max_age, path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
