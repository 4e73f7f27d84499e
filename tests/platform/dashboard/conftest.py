"""Dashboard fixtures: its own live app (fresh database, shared engine and Redis), headless Chromium
from Debian's `chromium` package driven by Playwright, and a signed-in httpx client.

Screenshots go to $LORAPLEX_SCREENSHOTS when set (docs/screenshots to refresh the docs), else to a
temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.platform import factories

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def dash_server(make_settings, start_app, redis_db):
    """An app of its own, so the overview lists only this module's tenants."""
    return start_app(make_settings(redis_url=redis_db()))


@pytest.fixture(scope="session")
def dash_admin(dash_server):
    with factories.client(dash_server.url, dash_server.settings.admin_key.get_secret_value()) as c:
        yield c


@pytest.fixture(scope="session")
def admin_key(dash_server) -> str:
    return dash_server.settings.admin_key.get_secret_value()


@pytest.fixture(scope="session")
def dash_gateway(dash_server):
    return dash_server.server.config.app.state.gateway


@pytest.fixture(scope="module")
def browser():
    """Module-scoped: Playwright's sync API runs an event loop on this thread while it is open, which
    would break asyncio.run() in the tests after it."""
    if shutil.which(CHROMIUM) is None:
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get install chromium (scripts/install test)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, dash_server):
    context = browser.new_context(base_url=dash_server.url, viewport={"width": 1320, "height": 900},
                                  device_scale_factor=1)
    context.set_default_timeout(20_000)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the confirm() before revoke and delete
    errors = []  # script errors and Content-Security-Policy refusals; refused sign-ins (4xx) are expected
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "Failed to load resource"
            not in m.text else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert errors == []


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    out = os.environ.get("LORAPLEX_SCREENSHOTS")
    path = Path(out) if out else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sign_in(page, key: str) -> None:
    page.goto("/admin/login")
    page.fill("#api_key", key)
    page.click("form button[type=submit]")


@contextmanager
def signed_in_client(base_url: str, key: str) -> Iterator[httpx.Client]:
    """httpx with a dashboard session (its cookie jar keeps lpx_session)."""
    with httpx.Client(base_url=base_url, timeout=60, follow_redirects=False) as c:
        r = c.post("/admin/login", data={"csrf_token": csrf_of(c.get("/admin/login").text), "api_key": key})
        assert r.status_code == 303 and r.headers["location"] == "/admin", r.text
        yield c


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)
