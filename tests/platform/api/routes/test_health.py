"""/health and /metrics."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics(server, make_tenant):
    t = make_tenant(rpm=1)
    ok = t.chat(max_tokens=2)
    assert ok.status_code == 200
    assert t.chat(max_tokens=2).status_code == 429
    text = httpx.get(server.url + "/metrics").text
    usage = ok.json()["usage"]  # the engine's per-tenant counters (by tenant id) agree with the usage
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]  # a cached prefix is not
    assert (f'loraplex_tenant_tokens_computed_total{{kind="prompt",tenant_id="{t.id}"}} '
            f'{float(computed)}') in text
    assert (f'loraplex_tenant_tokens_computed_total{{kind="output",tenant_id="{t.id}"}} '
            f'{float(usage["completion_tokens"])}') in text
    assert f'loraplex_tenant_requests_waiting{{tenant_id="{t.id}"}} 0.0' in text
    assert f'loraplex_tenant_requests_running{{tenant_id="{t.id}"}} 0.0' in text
    assert f'loraplex_requests_total{{endpoint="chat.completions",status="ok",tenant="{t.name}"}} 1.0' in text
    assert f'loraplex_requests_total{{endpoint="chat.completions",status="429",tenant="{t.name}"}} 1.0' in text
    assert f'loraplex_tokens_total{{kind="completion",tenant="{t.name}"}}' in text
    for name in ("loraplex_time_to_first_token_seconds_bucket", "loraplex_time_per_output_token_seconds_bucket",
                 "loraplex_num_requests_waiting", "loraplex_num_requests_running", "loraplex_kv_cache_usage",
                 "loraplex_adapter_hits_total", "loraplex_adapter_misses_total", "loraplex_adapter_loads_total",
                 "loraplex_adapter_evictions_total", "loraplex_adapters_resident", "loraplex_prefix_cache_queries_total",
                 "loraplex_prefix_cache_hits_total", "loraplex_prefix_cache_blocks",
                 "loraplex_prefix_cache_evictions_total"):
        assert name in text, name


def test_metrics_can_require_an_admin_key(make_settings, start_app):
    """LORAPLEX_METRICS_AUTH: its series name tenants, so /metrics takes the admin key; none, a wrong one or a
    tenant's gets OpenAI's error shape, and /health stays open for load balancers."""
    from tests.platform import factories

    settings = make_settings(metrics_auth=True)
    app = start_app(settings)
    admin_key = settings.admin_key.get_secret_value()
    with factories.client(app.url, admin_key) as admin:
        tenant = factories.make_tenant(admin, app.url)
        ok = admin.get("/metrics")
    assert ok.status_code == 200 and "loraplex_num_requests_running" in ok.text
    missing = httpx.get(app.url + "/metrics")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(app.url + "/metrics", headers={"Authorization": "Bearer lpx-nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    denied = tenant.client.get("/metrics")
    assert denied.status_code == 403, denied.text
    assert denied.json() == {"error": {"message": "GET /metrics takes an admin key on this server "
                                                  "(LORAPLEX_METRICS_AUTH).",
                                       "type": "permission_error", "param": None, "code": "insufficient_permissions"}}
    assert httpx.get(app.url + "/health").status_code == 200
    tenant.client.close()
