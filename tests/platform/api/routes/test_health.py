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
