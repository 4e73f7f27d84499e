"""Rendering: Jinja2 templates (autoescaped), their filters, security headers, and the route class
that turns refusals into pages (a missing session redirects to sign-in; the rest get an error page)."""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path
from urllib.parse import urlencode

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape

from loraplex.platform.dashboard.auth import CsrfRejected, SignInRequired
from loraplex.platform.dashboard.charts import short_number
from loraplex.platform.errors import APIError
from loraplex.platform.models import utcnow

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
STATIC_TYPES = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
# Pages fetch only their own CSS and JS; no inline script or style (SVG presentation attributes are fine).
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}
LOGIN_PATH = "/admin/login"


def _version(name: str) -> str:
    return hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest()[:10]


STATIC_VERSIONS = {name: _version(name) for name in STATIC_TYPES}


def fmt_num(n) -> str:
    return "—" if n is None else f"{n:,}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_when(t: dt.datetime | None) -> str:
    return "—" if t is None else f"{t:%Y-%m-%d %H:%M} UTC"


def fmt_ago(t: dt.datetime | None) -> str:
    """'never', 'just now', '5 min ago', '3 h ago', '2 d ago'; future times as 'in ...'."""
    if t is None:
        return "never"
    seconds = (utcnow() - t).total_seconds()
    future, seconds = seconds < 0, abs(seconds)
    if seconds < 60:
        return "just now" if not future else "in under a minute"
    for div, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= div:
            text = f"{int(seconds // div)} {unit}"
            return f"in {text}" if future else f"{text} ago"
    return ""


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                  trim_blocks=True, lstrip_blocks=True)
env.filters.update(num=fmt_num, bytes=fmt_bytes, when=fmt_when, ago=fmt_ago, pct=fmt_pct, short=short_number)
env.globals["timedelta"] = dt.timedelta
env.globals["static_url"] = lambda name: f"/admin/static/{name}?v={STATIC_VERSIONS[name]}"


def url_with(path: str, query: dict, **params) -> str:
    """`path` with the query `query` after changing some parameters (None drops one)."""
    query = {k: v for k, v in query.items() if k not in params}
    query.update({k: str(v) for k, v in params.items() if v is not None})
    return f"{path}?{urlencode(query)}" if query else path


def render(request: Request, template: str, status_code: int = 200, *, path: str | None = None,
           **context) -> HTMLResponse:
    """`path`: the page's own GET path, which its links keep (a POST may answer with the page)."""
    query = dict(request.query_params) if request.method == "GET" else {}
    link = lambda **p: url_with(path or request.url.path, query, **p)
    html = env.get_template(template).render(request=request, link=link, **context)
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers={"cache-control": "no-store"})


def error_page(request: Request, status_code: int, message: str) -> HTMLResponse:
    return render(request, "error.html", status_code, status=status_code, message=message)


class DashboardRoute(APIRoute):
    """Answers in HTML: no session -> 303 to sign-in; a bad CSRF token -> 403; other refusals -> a page."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except SignInRequired:
                return redirect(LOGIN_PATH)
            except CsrfRejected:
                return error_page(request, 403, "This form has expired or did not come from this dashboard "
                                                "(its CSRF token is missing or wrong). Reload the page and try again.")
            except APIError as e:
                return error_page(request, e.status_code, e.message)
            except RequestValidationError as e:
                first = e.errors()[0] if e.errors() else {}
                return error_page(request, 400, f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg')}")

        return route
