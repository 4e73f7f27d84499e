"""The dashboard in headless Chromium: sign in, create a tenant, set its quota, issue and revoke keys,
see the quota hold on the API (429) and real requests in the charts; delete an adapter and a tenant.
Each page is saved as a screenshot (see conftest.py)."""

from __future__ import annotations

import datetime as dt
import random
import re
from collections import Counter

import httpx
import pytest

from loraplex.platform.usage import Usage
from tests.platform import factories
from tests.platform.dashboard.conftest import sign_in
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow
TODAY = dt.datetime.now(dt.timezone.utc).date()


def seed_history(gateway, tenant_id: int, num_days: int, scale: float, seed: int) -> dict[dt.date, Counter]:
    """Backdated requests for the days before today, through the real usage writer (records and
    roll-ups), so the charts have a history to show; returns what was written per day."""
    rng = random.Random(seed)
    written = {}
    for back in range(1, num_days + 1):
        day = TODAY - dt.timedelta(days=back)
        trend = 1 + 0.04 * (num_days - back)  # growing usage, quieter weekends
        n = max(1, int(scale * trend * (0.45 if day.weekday() >= 5 else 1) * rng.uniform(0.8, 1.2)))
        c = written[day] = Counter()
        for i in range(n):
            ok = rng.random() > 0.06
            u = Usage(request_id=f"seed-{tenant_id}-{back}-{i}", tenant_id=tenant_id, api_key_id=None, adapter=None,
                      endpoint="chat.completions", status="ok" if ok else "error",
                      num_prompt_tokens=rng.randint(60, 500), num_completion_tokens=rng.randint(20, 350) if ok else 0,
                      created_at=dt.datetime.combine(day, dt.time(12)))
            gateway.usage.record(u)
            c.update(requests=1, failed=not ok, prompt=u.num_prompt_tokens, completion=u.num_completion_tokens)
    gateway.usage.flush()
    return written


@pytest.fixture(scope="module")
def neighbours(dash_admin, dash_server, dash_gateway):
    """Other tenants for the overview, with history and a real request each today."""
    for i, (name, quota) in enumerate([
        ("globex", dict(rpm=120, tpm=200_000, token_budget=5_000_000, budget_period="month")),
        ("initech", dict(rpm=30, tpm=40_000, token_budget=250_000, budget_period="week")),
        ("umbrella", dict(rpm=None, tpm=None)),
    ]):
        r = dash_admin.post("/admin/tenants", json={"name": name, "quota": {**factories.UNLIMITED, **quota}})
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        key = dash_admin.post(f"/admin/tenants/{tid}/keys", json={"name": "app"}).json()["key"]
        seed_history(dash_gateway, tid, 20, scale=[40, 12, 25][i], seed=tid)
        with factories.client(dash_server.url, key) as c:
            assert factories.TenantClient(tid, name, key, c).chat(max_tokens=3).status_code == 200


def test_sign_in_refuses_tenant_keys_and_wrong_keys(page, dash_admin, dash_server, shots):
    page.goto("/admin")
    assert page.url.endswith("/admin/login")  # no session: to the sign-in form
    page.screenshot(path=shots / "login.png")
    tenant = factories.make_tenant(dash_admin, dash_server.url)
    tenant.client.close()
    for key, status, message in ((tenant.key, 403, "tenant's key"), ("lpx-" + "x" * 43, 401, "not valid")):
        with page.expect_response(lambda r: r.request.method == "POST") as response:
            sign_in(page, key)
        assert response.value.status == status
        assert message in page.locator(".flash-error").text_content()
        assert "lpx_session" not in {c["name"] for c in page.context.cookies()}
    page.goto("/admin")
    assert page.url.endswith("/admin/login")
    assert dash_admin.delete(f"/admin/tenants/{tenant.id}").status_code == 200


def test_operator_flow(page, neighbours, dash_server, dash_admin, dash_gateway, admin_key, peft_adapters, shots):
    sign_in(page, admin_key)
    assert page.url.endswith("/admin") and page.locator("h1").text_content() == "Overview"
    session = next(c for c in page.context.cookies() if c["name"] == "lpx_session")
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/admin"

    # create a tenant
    page.fill("input[name=name]", "acme")
    page.click("text=Create tenant")
    tid = int(re.search(r"/admin/ui/tenants/(\d+)", page.url).group(1))
    assert "Tenant created" in page.locator(".flash-ok").text_content()

    # its quota, saved through the admin API's code path; a bad value is refused and changes nothing
    for field, value in (("rpm", "3"), ("tpm", "5000"), ("max_concurrent_requests", "4"),
                         ("token_budget", "400000"), ("max_adapters", "5"), ("max_adapter_bytes", ""),
                         ("weight", "2.5"), ("priority", "1")):
        page.fill(f"#q-{field}", value)
    page.select_option("#q-budget_period", "month")
    page.click("text=Save quota")
    assert "Quota saved" in page.locator(".flash-ok").text_content()
    quota = {"rpm": 3, "tpm": 5000, "max_concurrent_requests": 4, "token_budget": 400000, "budget_period": "month",
             "max_adapters": 5, "max_adapter_bytes": None, "weight": 2.5, "priority": 1, "min_priority": 0}
    assert dash_admin.get(f"/admin/tenants/{tid}/quota").json() == quota
    page.fill("#q-rpm", "-5")
    page.click("text=Save quota")
    assert "rpm" in page.locator(".flash-error").text_content()
    assert dash_admin.get(f"/admin/tenants/{tid}/quota").json() == quota

    # issue keys: shown once
    keys = {}
    for name in ("prod", "ci"):
        page.fill("#keys input[name=name]", name)
        page.fill("#keys input[name=expires_in_days]", "90" if name == "ci" else "")
        page.click("text=Issue key")
        keys[name] = page.locator("#new-key-value").text_content().strip()
        assert keys[name].startswith("lpx-") and len(keys[name]) >= 47
    page.screenshot(path=shots / "tenant-new-key.png")
    page.goto(f"/admin/ui/tenants/{tid}")
    assert keys["ci"] not in page.content() and page.locator(f"tr[data-key='{keys['ci'][:12]}']").count() == 1

    # revoke one: refused on the API at once
    ci = httpx.Client(base_url=dash_server.url, headers={"Authorization": f"Bearer {keys['ci']}"})
    assert ci.get("/v1/models").status_code == 200
    page.click(f"tr[data-key='{keys['ci'][:12]}'] >> text=Revoke")
    assert "Key revoked" in page.locator(".flash-ok").text_content()
    assert page.locator(f"tr[data-key='{keys['ci'][:12]}']").get_attribute("data-state") == "revoked"
    assert ci.get("/v1/models").status_code == 401
    ci.close()

    # real requests with the other key: the quota of 3 requests per minute holds
    with factories.client(dash_server.url, keys["prod"]) as c:
        acme = factories.TenantClient(tid, "acme", keys["prod"], c)
        assert acme.upload("support-bot", peft_adapters[0]).status_code == 201
        ok = [acme.chat(max_tokens=3), acme.chat("support-bot", max_tokens=3)]
        assert [r.status_code for r in ok] == [200, 200]
        body = {"model": factories.BASE_MODEL, "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 200, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as stream:  # left early: a failed request
            assert stream.status_code == 200
            next(stream.iter_lines())
        refused = acme.chat(max_tokens=3)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    page.goto("/admin")  # at once, before a request's worth (20 s) refills: the bucket is full
    row = page.locator("tr[data-tenant=acme]")
    assert row.locator("[data-gauge=rpm] .gauge-text").text_content().split() == ["3", "/", "3"]
    assert int(row.locator("[data-gauge=tpm] .gauge-text b").text_content().replace(",", "")) > 0
    prompt_tokens = ok[0].json()["usage"]["prompt_tokens"]
    history = seed_history(dash_gateway, tid, 20, scale=30, seed=7)

    def today():
        rows = dash_admin.get("/admin/usage", params={"tenant_id": tid, "start": TODAY.isoformat()}).json()["data"]
        return Counter({k: sum(r[k] for r in rows) for k in ("num_requests", "num_failed", "num_prompt_tokens",
                                                             "num_completion_tokens")})

    wait_until(lambda: today()["num_requests"] == 3, timeout=20, what="the aborted request's usage")
    now = today()
    assert now["num_failed"] == 1 and now["num_prompt_tokens"] == 3 * prompt_tokens

    # the charts show those requests (today's bars) on top of the history
    page.goto(f"/admin/ui/tenants/{tid}")
    seeded = sum(history.values(), Counter())
    last14 = sum((history[TODAY - dt.timedelta(days=d)] for d in range(1, 14)), Counter())

    def total(chart, series):
        return int(page.locator(f"#{chart} [data-total={series}]").text_content().replace(",", ""))

    assert total("chart-requests", "s-ok") == last14["requests"] - last14["failed"] + 2
    assert total("chart-requests", "s-error") == last14["failed"] + 1
    assert total("chart-tokens", "s-prompt") == last14["prompt"] + now["num_prompt_tokens"]
    assert total("chart-tokens", "s-completion") == last14["completion"] + now["num_completion_tokens"]
    label = f"{TODAY:%a %d %b}"
    assert page.locator("#chart-requests rect.s-ok").last.text_content() == f"{label}: 2 succeeded"
    assert page.locator("#chart-requests rect.s-error").last.text_content() == f"{label}: 1 failed"
    assert page.locator("#chart-tokens rect.s-prompt").last.text_content() == f"{label}: {3 * prompt_tokens} prompt tokens"
    assert page.locator("[data-gauge=rpm] .gauge-text").first.text_content().split()[1:] == ["/", "3"]
    adapter = page.locator("tr[data-adapter=support-bot]")
    assert "q_proj" in adapter.text_content() and adapter.locator("td").nth(1).text_content() == "8"
    assert adapter.locator(".tier").text_content() == "slots"
    page.screenshot(path=shots / "tenant.png", full_page=True)

    # another range: 7 days; then days without today
    page.click("#usage >> text=7 d")
    assert f"start={TODAY - dt.timedelta(days=6)}" in page.url
    assert page.locator("#chart-tokens rect.s-prompt").count() == 7
    week_ago = TODAY - dt.timedelta(days=7)
    page.goto(f"/admin/ui/tenants/{tid}?start={week_ago}&end={TODAY - dt.timedelta(days=1)}")
    past = sum((history[week_ago + dt.timedelta(days=d)] for d in range(7)), Counter())
    assert total("chart-tokens", "s-prompt") == past["prompt"] and seeded["prompt"] > past["prompt"]

    # the overview: today's use, current RPM/TPM against the limits, budget; the engine panel refreshes
    page.goto("/admin")
    assert row.locator("[data-col=requests]").inner_text().split() == ["3", "1", "failed"]
    assert "/ 400k" in row.locator("[data-gauge=budget]").text_content()
    assert "monthly · resets\xa001\xa0" in row.locator("[data-gauge=budget]").text_content()
    assert page.locator("tr[data-tenant=globex]").count() == 1
    with page.expect_response(lambda r: "/admin/ui/engine" in r.url, timeout=8000) as refreshed:
        pass
    assert refreshed.value.status == 200 and page.locator("[data-stat=num_running]").text_content() == "0"
    page.screenshot(path=shots / "overview.png", full_page=True)

    # delete the adapter from the tenant page
    page.goto(f"/admin/ui/tenants/{tid}")
    page.click("tr[data-adapter=support-bot] >> text=Delete")
    assert "Adapter deleted" in page.locator(".flash-ok").text_content()
    assert dash_admin.get(f"/admin/tenants/{tid}/adapters").json()["data"] == []


def test_delete_tenant_and_sign_out(page, dash_admin, dash_server, admin_key):
    tenant = factories.make_tenant(dash_admin, dash_server.url)
    assert tenant.client.get("/v1/models").status_code == 200
    sign_in(page, admin_key)
    page.goto(f"/admin/ui/tenants/{tenant.id}")
    page.click("text=Delete tenant")
    assert page.url.endswith("/admin?notice=tenant-deleted")
    assert dash_admin.get(f"/admin/tenants/{tenant.id}").status_code == 404
    assert tenant.client.get("/v1/models").status_code == 401
    tenant.client.close()
    page.click("text=Sign out")
    assert "/admin/login" in page.url and "signed out" in page.content()
    page.goto("/admin")
    assert page.url.endswith("/admin/login")
