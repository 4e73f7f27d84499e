"""/admin over HTTP: tenants, keys, quotas, usage per tenant/adapter/day, engine state; admin keys only."""

from __future__ import annotations

import datetime as dt

import pytest

from tests.platform.factories import BASE_MODEL
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow


def test_tenant_lifecycle(admin, make_tenant):
    r = admin.post("/admin/tenants", json={"name": "lifecycle-co", "quota": {"rpm": 5}})
    assert r.status_code == 201
    tenant = r.json()
    assert tenant["quota"]["rpm"] == 5 and tenant["quota"]["tpm"] == 100_000  # the rest from the defaults
    assert admin.post("/admin/tenants", json={"name": "lifecycle-co"}).status_code == 409
    assert admin.post("/admin/tenants", json={"name": "bad name!"}).status_code == 400
    tid = tenant["id"]
    assert admin.get(f"/admin/tenants/{tid}").json()["name"] == "lifecycle-co"
    assert admin.patch(f"/admin/tenants/{tid}", json={"name": "renamed-co"}).json()["name"] == "renamed-co"
    page = admin.get("/admin/tenants", params={"limit": 1}).json()
    assert len(page["data"]) == 1 and page["total"] >= 1
    key = admin.post(f"/admin/tenants/{tid}/keys", json={"name": "ci"}).json()["key"]
    r = admin.delete(f"/admin/tenants/{tid}")
    assert r.json() == {"id": tid, "object": "tenant", "deleted": True}
    assert admin.get(f"/admin/tenants/{tid}").status_code == 404
    import httpx

    assert httpx.get(str(admin.base_url) + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    # the id of the tenant deleted last is not the next tenant's (SQLite reused it, with its usage and limits)
    after = admin.post("/admin/tenants", json={"name": "after-co"}).json()
    assert after["id"] > tid


def test_keys_are_shown_once(admin, make_tenant):
    t = make_tenant()
    r = admin.post(f"/admin/tenants/{t.id}/keys", json={"name": "second", "expires_at": "2999-01-01T00:00:00Z"})
    assert r.status_code == 201
    issued = r.json()
    assert issued["key"].startswith("lpx-") and len(issued["key"]) >= 47
    assert issued["prefix"] == issued["key"][:12] and issued["expires_at"] == "2999-01-01T00:00:00Z"
    listed = admin.get(f"/admin/tenants/{t.id}/keys").json()["data"]
    assert [k["name"] for k in listed] == ["test", "second"]
    assert all("key" not in k for k in listed)
    revoked = admin.delete(f"/admin/keys/{issued['id']}").json()
    assert revoked["revoked_at"] is not None


def test_quota_read_and_set(admin, make_tenant):
    t = make_tenant()
    q = admin.get(f"/admin/tenants/{t.id}/quota").json()
    assert q["rpm"] is None and q["budget_period"] == "month"
    q = admin.patch(f"/admin/tenants/{t.id}/quota", json={"rpm": 7, "token_budget": 1000, "budget_period": "day"}).json()
    assert (q["rpm"], q["token_budget"], q["budget_period"], q["tpm"]) == (7, 1000, "day", None)
    assert (q["weight"], q["priority"], q["min_priority"]) == (1.0, 0, 0)  # the scheduling fields' defaults
    q = admin.patch(f"/admin/tenants/{t.id}/quota", json={"weight": 4, "priority": 2, "min_priority": -5}).json()
    assert (q["weight"], q["priority"], q["min_priority"], q["rpm"]) == (4.0, 2, -5, 7)
    assert admin.get(f"/admin/tenants/{t.id}").json()["quota"]["weight"] == 4.0
    for bad in ({"rpm": -1}, {"budget_period": "year"}, {"nope": 1}, {"weight": 0}, {"weight": None},
                {"priority": 2**31}, {"min_priority": "high"}, {"weight": 1e-320}, {"weight": 9e-7},
                {"rpm": 10**30}, {"max_adapter_bytes": 2**70}, {"token_budget": 2**63}):
        r = admin.patch(f"/admin/tenants/{t.id}/quota", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), (bad, r.text)
    q = admin.patch(f"/admin/tenants/{t.id}/quota", json={"weight": 1e-6, "token_budget": 2**63 - 1}).json()
    assert (q["weight"], q["token_budget"]) == (1e-6, 2**63 - 1)  # the bounds themselves are taken
    # a default priority the tenant's own requests could not ask for, given or left as it is: nothing saved
    for bad in ({"min_priority": 3}, {"priority": -6}, {"priority": 0, "min_priority": 1, "rpm": 9}):
        r = admin.patch(f"/admin/tenants/{t.id}/quota", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)
        assert "more urgent than min_priority" in r.json()["error"]["message"]
    q = admin.get(f"/admin/tenants/{t.id}/quota").json()
    assert (q["priority"], q["min_priority"], q["rpm"]) == (2, -5, 7)
    r = admin.post("/admin/tenants", json={"name": f"{t.name}-p", "quota": {"priority": -1}})  # min_priority 0
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert admin.post("/admin/tenants", json={"name": f"{t.name}-p", "quota": {"priority": -1, "min_priority": -1}}
                      ).status_code == 201


def test_numbers_past_the_database_range_are_refused_not_500(admin, make_tenant):
    """Ids, offsets and durations past what the database or datetime holds: 400 naming the field, and the
    connection stays usable (a 500 from the driver's overflow used to drop it)."""
    t, huge = make_tenant(), 10**23
    for method, url, body, param in (
        ("GET", f"/admin/tenants/{huge}", None, "tenant_id"),
        ("DELETE", f"/admin/keys/{huge}", None, "key_id"),
        ("GET", f"/admin/usage?offset={huge}", None, "offset"),
        ("GET", f"/admin/usage?tenant_id={huge}", None, "tenant_id"),
        ("POST", f"/admin/tenants/{t.id}/keys", {"name": "k", "expires_in_s": 10**30}, "expires_in_s"),
        ("POST", "/admin/tenants", {"name": "q", "quota": {"rpm": 10**30}}, "quota.rpm"),
    ):
        r = admin.request(method, url, json=body)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == param, (url, r.text)
    assert admin.get(f"/admin/tenants/{2**63 - 1}").status_code == 404  # in range, no such row
    assert admin.get(f"/admin/tenants/{t.id}").status_code == 200  # the same connection, still served


def test_admin_api_refuses_tenant_keys(make_tenant):
    t = make_tenant()
    for method, path in (("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("GET", "/admin/usage"),
                         ("GET", "/admin/engine"), ("DELETE", "/admin/keys/1")):
        r = t.client.request(method, path, json={"name": "x"} if method == "POST" else None)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "insufficient_permissions"


def test_usage_per_tenant_adapter_and_day(admin, make_tenant, peft_adapters, gateway):
    t = make_tenant()
    assert t.upload("mine", peft_adapters[0]).status_code == 201
    responses = [t.chat(max_tokens=3), t.chat(max_tokens=3), t.chat("mine", max_tokens=3)]
    tokens = [(r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) for r in responses]
    assert t.chat("missing").status_code == 404  # refused before the engine: not a usage record
    gateway.usage.flush()
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    rows = admin.get("/admin/usage", params={"tenant_id": t.id, "start": today}).json()
    by_adapter = {row["adapter"]: row for row in rows["data"]}
    assert rows["total"] == 2 and set(by_adapter) == {None, "mine"}
    base = by_adapter[None]
    assert (base["day"], base["num_requests"], base["num_failed"]) == (today, 2, 0)
    assert base["num_prompt_tokens"] == tokens[0][0] + tokens[1][0]
    assert base["num_completion_tokens"] == tokens[0][1] + tokens[1][1]
    assert by_adapter["mine"]["num_completion_tokens"] == tokens[2][1]
    only = admin.get("/admin/usage", params={"tenant_id": t.id, "adapter": "mine"}).json()["data"]
    assert [r["adapter"] for r in only] == ["mine"]
    assert admin.get(f"/admin/tenants/{t.id}/adapters").json()["data"][0]["last_used_at"] is not None


def test_engine_state(admin, make_tenant, peft_adapters):
    t = make_tenant()
    assert t.upload("resident", peft_adapters[1]).status_code == 201
    assert t.chat("resident", max_tokens=1).status_code == 200
    s = admin.get("/admin/engine").json()
    assert s["model"] == BASE_MODEL and s["quota_store"] == "ok"
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and 0 <= s["kv_cache_usage"] <= 1
    assert s["num_steps"] >= 1 and s["num_batched_rows"] >= 1
    tiers = s["adapters"]["tiers"]
    assert {"slots", "cpu", "disk"} <= set(tiers) and tiers["slots"]["misses"] >= 1
    mine = [tier for name, tier in s["adapters"]["adapters"].items() if name.startswith(f"{t.id}:resident:")]
    assert mine == ["slots"]


def test_first_usage_rows_page(admin, make_tenant):
    t = make_tenant()
    for _ in range(2):
        assert t.chat(max_tokens=1).status_code == 200
    wait_until(lambda: admin.get("/admin/usage", params={"tenant_id": t.id}).json()["total"] == 1, timeout=10)
    page = admin.get("/admin/usage", params={"limit": 1, "offset": 0}).json()
    assert len(page["data"]) == 1 and page["total"] >= 1
