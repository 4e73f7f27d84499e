"""Sign-in and sign-out pages (/admin/login, /admin/logout) and the static assets (/admin/static)."""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from loraplex.platform import crud
from loraplex.platform.api.deps import GatewayDep, SessionDep
from loraplex.platform.dashboard.auth import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    SESSION_TTL,
    Operator,
    check_csrf,
    clear_cookie,
    end_session,
    find_session,
    set_cookie,
    start_session,
)
from loraplex.platform.dashboard.pages import STATIC_DIR, STATIC_TYPES, DashboardRoute, redirect, render
from loraplex.platform.errors import not_found

router = APIRouter(prefix="/admin", include_in_schema=False, route_class=DashboardRoute)


@router.get("/static/{name}")
def static(name: str) -> Response:
    if name not in STATIC_TYPES:
        raise not_found(f"No static file {name!r}.")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_TYPES[name],
                        headers={"cache-control": "public, max-age=86400", "x-content-type-options": "nosniff"})


@router.get("/login")
def login_form(request: Request, s: SessionDep) -> Response:
    if find_session(s, request.cookies.get(SESSION_COOKIE)) is not None:
        return redirect("/admin")
    return login_page(request)


def login_page(request: Request, status_code: int = 200, error: str | None = None) -> Response:
    token = request.cookies.get(LOGIN_CSRF_COOKIE, "")  # kept: a second sign-in tab still works
    if not (32 <= len(token) <= 64 and token.replace("-", "").replace("_", "").isalnum()):
        token = secrets.token_urlsafe(32)  # double-submit: the form and the cookie carry the same token
    response = render(request, "login.html", status_code, csrf_token=token, error=error,
                      signed_out=request.query_params.get("signed_out") == "1")
    set_cookie(response, request, LOGIN_CSRF_COOKIE, token, max_age=3600)
    return response


@router.post("/login")
async def login(request: Request, gw: GatewayDep) -> Response:
    form = await request.form()
    check_csrf(request.cookies.get(LOGIN_CSRF_COOKIE), form)
    key = form.get("api_key")
    key = key.strip() if isinstance(key, str) else ""

    def sign_in() -> str | int:
        with gw.sessions() as s:
            row = crud.find_key(s, key)
            if row is None:
                return 401
            if row.role != "admin":
                return 403
            return start_session(s, row)

    result = await asyncio.to_thread(sign_in)
    if result == 401:
        return login_page(request, 401, "That key is not valid: it is unknown, revoked or expired.")
    if result == 403:
        return login_page(request, 403, "That is a tenant's key. The dashboard takes an admin key.")
    response = redirect("/admin")
    set_cookie(response, request, SESSION_COOKIE, result, max_age=int(SESSION_TTL.total_seconds()))
    clear_cookie(response, request, LOGIN_CSRF_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request, gw: GatewayDep, op: Operator) -> Response:
    check_csrf(op.csrf_token, await request.form())

    def sign_out() -> None:
        with gw.sessions() as s:
            end_session(s, request.cookies.get(SESSION_COOKIE))

    await asyncio.to_thread(sign_out)
    response = redirect("/admin/login?signed_out=1")
    clear_cookie(response, request, SESSION_COOKIE)
    return response
