"""Per-tenant limits over HTTP (Redis-backed app): exactly the 429s and headers of OpenAI's API."""

from __future__ import annotations

import math
import time

import pytest

from tests.platform.factories import BASE_MODEL
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow


def assert_retry_headers(r):
    ms = int(r.headers["retry-after-ms"])
    assert ms >= 1 and int(r.headers["retry-after"]) == max(1, math.ceil(ms / 1000))
    return ms


def test_requests_per_minute(make_tenant):
    t = make_tenant(rpm=3)
    ok = [t.chat(max_tokens=1) for _ in range(3)]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in ok)
    assert "x-ratelimit-limit-tokens" not in ok[0].headers  # no token limit set
    r = t.chat(max_tokens=1)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "requests" and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    ms = assert_retry_headers(r)
    assert 10_000 < ms <= 20_000  # the next request fits 60 s / 3 after the first


def test_tokens_per_minute_reserve_max_tokens_and_refund(make_tenant):
    t = make_tenant(tpm=100)
    start = time.monotonic()
    first = t.chat(content="Say hi", max_tokens=40)
    assert first.status_code == 200
    usage = first.json()["usage"]
    prompt, used = usage["prompt_tokens"], usage["total_tokens"]
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100 - prompt - 40  # reserved at admission
    second = t.chat(content="Say hi", max_tokens=40)
    elapsed = time.monotonic() - start  # the bucket refills 1 token per 0.6 s meanwhile
    assert second.status_code == 429
    err = second.json()["error"]
    assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded"
    # the unused part of the first reservation came back: what is left is 100 - actual use (+ refill)
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 100 - used <= remaining <= 100 - used + math.ceil(elapsed / 0.6) + 1
    ms = assert_retry_headers(second)
    assert abs(ms - (prompt + 40 - remaining) * 600) <= 600 + elapsed * 1000


def test_request_over_the_whole_tpm_is_refused(make_tenant):
    t = make_tenant(tpm=50)
    r = t.chat(max_tokens=60)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
    assert "retry-after" not in r.headers  # waiting would not help


def test_concurrent_requests(make_tenant, admin):
    t = make_tenant(max_concurrent_requests=1)
    body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with t.client.stream("POST", "/v1/chat/completions", json=body) as first:
        assert first.status_code == 200
        next(first.iter_lines())
        r = t.chat(max_tokens=1)
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "requests" and "concurrent" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1" and r.headers["retry-after-ms"] == "1000"
    # leaving the stream aborts it and frees the slot
    wait_until(lambda: t.chat(max_tokens=1).status_code == 200, timeout=15, interval=0.2, what="the slot")


def test_token_budget(make_tenant, admin):
    t = make_tenant(token_budget=100, budget_period="month")
    first = t.chat(max_tokens=4)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    cost = first.json()["usage"]["prompt_tokens"] + 4
    n_ok = 1
    while used + cost <= 100:
        r = t.chat(max_tokens=4)
        assert r.status_code == 200
        used += r.json()["usage"]["total_tokens"]
        n_ok += 1
    r = t.chat(max_tokens=4)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "insufficient_quota" and r.json()["error"]["code"] == "insufficient_quota"
    assert f"{used} of 100 tokens" in r.json()["error"]["message"]
    # a smaller request that fits the rest of the budget still goes through; raising the budget works at once
    assert admin.patch(f"/admin/tenants/{t.id}/quota", json={"token_budget": 1000}).status_code == 200
    assert t.chat(max_tokens=4).status_code == 200


def test_quota_change_holds_at_once(make_tenant, admin):
    t = make_tenant()
    assert t.chat(max_tokens=1).status_code == 200
    assert admin.patch(f"/admin/tenants/{t.id}/quota", json={"max_concurrent_requests": 0}).status_code == 200
    assert t.chat(max_tokens=1).status_code == 429
