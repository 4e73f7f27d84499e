"""The dashboard over plain HTTP: cookies, CSRF on every form, sessions ending, paging, headers, and
the /admin JSON API beside it unchanged."""

from __future__ import annotations

import re

import httpx
import pytest

from loraplex.platform import crud
from tests.platform import factories
from tests.platform.dashboard.conftest import csrf_of, signed_in_client

pytestmark = pytest.mark.slow


@pytest.fixture
def operator(dash_server, admin_key):
    with signed_in_client(dash_server.url, admin_key) as c:
        yield c


def test_cookies_and_headers(dash_server, admin_key):
    with httpx.Client(base_url=dash_server.url) as c:
        form = c.get("/admin/login")
        assert "httponly" in form.headers["set-cookie"].lower()
        r = c.post("/admin/login", data={"csrf_token": csrf_of(form.text), "api_key": admin_key})
        cookie = r.headers["set-cookie"].lower()
        assert r.status_code == 303 and "lpx_session=" in cookie
        assert all(part in cookie for part in ("httponly", "samesite=strict", "path=/admin"))
        page = c.get("/admin")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"
        css = c.get("/admin/static/dashboard.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert c.get("/admin/static/../auth.py").status_code == 404
        assert c.get("/admin/static/nope.js").status_code == 404
        assert "http://" not in page.text.replace(dash_server.url, "") and "https://" not in page.text


def test_every_form_wants_the_csrf_token(operator, dash_admin, dash_server):
    t = factories.make_tenant(dash_admin, dash_server.url, rpm=5)
    t.client.close()
    token = csrf_of(operator.get(f"/admin/ui/tenants/{t.id}").text)
    forms = [("/admin/ui/tenants", {"name": "csrf-co"}),
             (f"/admin/ui/tenants/{t.id}/quota", {"rpm": "1", "budget_period": "month"}),
             (f"/admin/ui/tenants/{t.id}/keys", {"name": "x"}),
             (f"/admin/ui/tenants/{t.id}/delete", {}),
             ("/admin/logout", {})]
    for path, data in forms:
        for sent in ({}, {"csrf_token": "forged"}):
            r = operator.post(path, data={**data, **sent})
            assert r.status_code == 403 and "CSRF" in r.text, path
    assert dash_admin.get(f"/admin/tenants/{t.id}/quota").json()["rpm"] == 5  # nothing changed
    assert dash_admin.get(f"/admin/tenants/{t.id}").status_code == 200
    assert operator.get("/admin").status_code == 200  # still signed in
    r = operator.post(f"/admin/ui/tenants/{t.id}/quota", data={"csrf_token": token, "rpm": "1", "budget_period": "day"})
    assert r.status_code == 303
    assert dash_admin.get(f"/admin/tenants/{t.id}/quota").json()["rpm"] == 1
    # the sign-in form: double-submit cookie
    with httpx.Client(base_url=dash_server.url) as fresh:
        r = fresh.post("/admin/login", data={"csrf_token": "x", "api_key": dash_server.settings.admin_key.get_secret_value()})
        assert r.status_code == 403 and "lpx_session" not in r.headers.get("set-cookie", "")


def test_sessions_end_at_sign_out_and_with_their_key(operator, dash_server, dash_gateway, dash_admin):
    stolen = operator.cookies["lpx_session"]
    r = operator.post("/admin/logout", data={"csrf_token": csrf_of(operator.get("/admin").text)})
    assert r.status_code == 303 and r.headers["location"].startswith("/admin/login")
    with httpx.Client(base_url=dash_server.url, cookies={"lpx_session": stolen}) as c:
        assert c.get("/admin").headers["location"] == "/admin/login"  # the session is gone server-side
    with dash_gateway.sessions() as s:
        row, key = crud.issue_key(s, None, name="second admin")
        s.commit()
    with signed_in_client(dash_server.url, key) as c:
        assert c.get("/admin").status_code == 200
        assert c.get("/admin/tenants").status_code == 401  # a session cookie is no key for the JSON API
        assert dash_admin.delete(f"/admin/keys/{row.id}").status_code == 200
        r = c.get("/admin")
        assert r.status_code == 303 and r.headers["location"] == "/admin/login"


def test_long_lists_are_paged(operator, dash_admin, dash_server):
    t = factories.make_tenant(dash_admin, dash_server.url)
    t.client.close()
    for i in range(11):
        assert dash_admin.post(f"/admin/tenants/{t.id}/keys", json={"name": f"k{i}"}).status_code == 201
    first = operator.get(f"/admin/ui/tenants/{t.id}").text
    assert first.count("data-key=") == 10 and "page 1 of 2 · 12 in all" in first
    second = operator.get(f"/admin/ui/tenants/{t.id}", params={"keys_page": 2}).text
    assert second.count("data-key=") == 2 and "page 2 of 2" in second
    assert operator.get(f"/admin/ui/tenants/{t.id}", params={"keys_page": 99}).text.count("data-key=") == 2
    assert operator.get("/admin/ui/tenants", params={"page": 1}).status_code == 200


def test_refusals_are_pages_and_the_json_api_is_unchanged(operator, dash_admin):
    token = csrf_of(operator.get("/admin").text)
    r = operator.post("/admin/ui/tenants", data={"csrf_token": token, "name": "bad name!"})
    assert r.status_code == 400 and "1 to 64 letters" in r.text and 'value="bad name!"' in r.text
    assert operator.post("/admin/ui/tenants", data={"csrf_token": token, "name": "twice"}).status_code == 303
    r = operator.post("/admin/ui/tenants", data={"csrf_token": token, "name": "twice"})
    assert r.status_code == 409 and "exists" in r.text
    tid = next(t["id"] for t in dash_admin.get("/admin/tenants").json()["data"] if t["name"] == "twice")
    r = operator.post(f"/admin/ui/tenants/{tid}/keys", data={"csrf_token": token, "expires_in_days": "soon"})
    assert r.status_code == 400 and "Key not issued" in r.text
    assert operator.post(f"/admin/ui/tenants/{tid}/delete", data={"csrf_token": token}).status_code == 303
    r = operator.get("/admin/ui/tenants/999999")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html") and "999999" in r.text
    r = operator.get("/admin/ui/tenants/999999", params={"start": "yesterday"})
    assert r.status_code == 400
    r = operator.post(f"/admin/ui/tenants/{tid}/quota", data={"csrf_token": token, "rpm": "5", "priority": "-2"})
    assert r.status_code == 404  # deleted above; a live tenant's refused quota:
    live = factories.make_tenant(dash_admin, str(operator.base_url))
    live.client.close()
    r = operator.post(f"/admin/ui/tenants/{live.id}/quota", data={"csrf_token": token, "rpm": "5", "priority": "-2"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("text/html")
    assert "Quota not saved: priority -2 is more urgent than min_priority 0" in r.text and 'value="-2"' in r.text
    assert dash_admin.get(f"/admin/tenants/{live.id}/quota").json()["rpm"] != 5  # nothing saved
    for bad in (2**63, "x"):  # past the column's range, not a number: a page, not the JSON API's body
        r = operator.get(f"/admin/ui/tenants/{bad}")
        assert r.status_code == 400 and r.headers["content-type"].startswith("text/html"), (bad, r.text[:200])
        assert "tenant_id" in r.text
    tenants = dash_admin.get("/admin/tenants")
    assert tenants.status_code == 200 and tenants.json()["object"] == "list"
    assert dash_admin.get("/admin/engine").json()["quota_store"] == "ok"
    assert operator.get("/admin/tenants").status_code == 401


def test_the_engine_panel_shows_each_tenants_share_of_the_batch_now(operator, dash_admin, dash_server):
    import threading

    t = factories.make_tenant(dash_admin, dash_server.url)
    done = threading.Event()

    def long_call():
        try:
            t.chat(max_tokens=200, ignore_eos=True)
        finally:
            done.set()

    threading.Thread(target=long_call, daemon=True).start()
    cells = None
    # Poll until the request is in the running batch: between admission and its
    # first step the panel rightly shows it as waiting (running 0, waiting 1).
    while not done.is_set() and cells is None:
        html = operator.get("/admin/ui/engine").text
        m = re.search(rf'<tr data-share-tenant="{t.id}">(.*?)</tr>', html, re.S)
        row = m and re.findall(r'<td[^>]*>(.*?)</td>', m.group(1), re.S)
        if row:
            assert row[0] == t.name and row[4] == "1"
            assert (row[1], row[2]) in {("1", "0"), ("0", "1")}
            if row[1] == "1":
                cells = row
    assert cells is not None, "the request ended before the panel showed it running"
    assert cells[3].startswith("100%")  # its one request is the whole batch
    done.wait(120)


def test_the_engine_panel_shows_the_prefix_cache_hit_rate(operator, dash_admin, dash_server):
    t = factories.make_tenant(dash_admin, dash_server.url)
    system = "You answer questions about the weather in exactly one sentence. " * 12
    for question in ("Is it sunny?", "Will it rain?"):
        r = t.client.post("/v1/chat/completions", json={
            "model": factories.BASE_MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
        assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    cache = dash_admin.get("/admin/engine").json()["prefix_cache"]
    html = operator.get("/admin/ui/engine").text
    shown = re.search(r'data-stat="prefix_cache_hit_rate">([^<]*)<', html).group(1)
    rate = cache["num_hit_tokens"] / cache["num_query_tokens"]
    assert shown == f"{100 * rate:.0f}%"
    assert f'{cache["num_hit_tokens"]:,} of {cache["num_query_tokens"]:,} prompt tokens' in html
