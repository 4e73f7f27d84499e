"""Redis going away mid-run: fail open to per-process limits, or fail closed; budgets always fail closed."""

from __future__ import annotations

import pytest

from loraplex.platform.security import new_key
from tests.platform import factories
from tests.platform.servers import RedisServer, wait_until

pytestmark = pytest.mark.slow


def test_fail_open_and_fail_closed(make_settings, start_app, tmp_path):
    redis = RedisServer().start()
    try:
        common = dict(home=tmp_path / "home", redis_url=redis.url, admin_key=new_key(), redis_timeout_s=0.2)
        fail_open = start_app(make_settings(quota_fail_mode="open", **common))
        fail_closed = start_app(make_settings(quota_fail_mode="closed", **common))  # same database and Redis
        with factories.client(fail_open.url, common["admin_key"]) as admin:
            free = factories.make_tenant(admin, fail_open.url)
            limited = factories.make_tenant(admin, fail_open.url, rpm=2)
            budgeted = factories.make_tenant(admin, fail_open.url, token_budget=100_000)
            free_closed = factories.TenantClient(free.id, free.name, free.key,
                                                 factories.client(fail_closed.url, free.key))
            for t in (free, budgeted, free_closed):
                assert t.chat(max_tokens=1).status_code == 200

            redis.kill()
            r = free_closed.chat(max_tokens=1)
            assert r.status_code == 503 and r.json()["error"]["code"] == "quota_store_unavailable"
            assert free.chat(max_tokens=1).status_code == 200  # open: this process's own counters
            r = budgeted.chat(max_tokens=1)
            assert r.status_code == 503 and "budget" in r.json()["error"]["message"]
            assert [limited.chat(max_tokens=1).status_code for _ in range(3)] == [200, 200, 429]
            assert admin.get("/admin/engine").json()["quota_store"] == "degraded"

            redis.start()  # back on the same port: both processes use it again
            wait_until(lambda: free_closed.chat(max_tokens=1).status_code == 200, timeout=10, interval=0.2)
            assert budgeted.chat(max_tokens=1).status_code == 200
            assert admin.get("/admin/engine").json()["quota_store"] == "ok"
            for t in (free, limited, budgeted, free_closed):
                t.client.close()
    finally:
        redis.kill()
