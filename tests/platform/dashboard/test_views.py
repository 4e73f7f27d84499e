"""Dashboard pieces without a browser: chart geometry, throughput, ranges, quota form parsing, and the
quota service's read-only view of a tenant's current use on both backends."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from loraplex.platform.dashboard.charts import Series, nice_step, short_number, stacked_bars
from loraplex.platform.dashboard.routes import parse_quota
from loraplex.platform.dashboard.views import MAX_RANGE_DAYS, Throughput, page, usage_range
from loraplex.platform.quotas.limits import Limits
from loraplex.platform.quotas.memory import MemoryBackend
from loraplex.platform.quotas.redis_backend import RedisBackend
from loraplex.platform.quotas.service import QuotaService


def test_stacked_bars_fit_the_plot():
    days = [dt.date(2026, 11, 1) + dt.timedelta(days=i) for i in range(30)]
    prompt, completion = list(range(30)), [2 * i for i in range(30)]
    c = stacked_bars("t", days, [Series("p", "s-prompt", prompt), Series("c", "s-completion", completion)])
    assert len(c.bars) == 2 * 29  # no bar for zero
    assert c.y_ticks[-1][1] == "100"  # 29 + 58 = 87 -> 100
    for b in c.bars:
        assert c.left <= b.x and b.x + b.width <= c.right_x and b.y >= 10 - 1e-6 and b.y + b.height <= c.baseline + 1e-6
    newest = [b for b in c.bars if "30 Nov" in b.title]
    assert [b.title for b in newest] == ["Mon 30 Nov: 29 p", "Mon 30 Nov: 58 c"]
    assert c.x_labels[-1][1] == "30 Nov" and len(c.x_labels) <= 8
    empty = stacked_bars("t", days[:1], [Series("p", "s", [0])])
    assert empty.is_empty and empty.bars == []
    assert [nice_step(v) for v in (0, 0.75, 1.5, 2.2, 3, 11, 21.75, 2500)] == [1, 1, 2, 5, 5, 20, 25, 2500]
    assert [label for _, label in stacked_bars("t", days[:2], [Series("p", "s", [0, 3])]).y_ticks] == ["0", "1", "2", "3", "4"]
    assert [short_number(v) for v in (0, 950, 1500, 2_000_000)] == ["0", "950", "1.5k", "2M"]


def test_throughput_and_ranges():
    t = Throughput(window_s=30)
    assert t.rate(100, now=0.0) is None
    assert t.rate(150, now=10.0) == 5.0
    assert t.rate(450, now=40.0) == pytest.approx(10.0)  # the sample at 0 s left the window
    today = dt.date(2026, 11, 30)
    assert usage_range(None, None, today) == (dt.date(2026, 11, 17), today)
    assert usage_range(today, dt.date(2026, 11, 1), today) == (dt.date(2026, 11, 1), today)
    start, end = usage_range(dt.date(2000, 1, 1), today, today)
    assert (end - start).days == MAX_RANGE_DAYS - 1
    assert (page(0, 10, 25).number, page(9, 10, 25).number, page(2, 10, 25).offset, page(1, 10, 0).num_pages) == (1, 3, 10, 1)


def test_quota_form_parsing():
    form = {"rpm": "1,000", "tpm": "", "max_concurrent_requests": " 4 ", "token_budget": "-1", "max_adapters": "ten",
            "budget_period": "week", "weight": " 0.5", "priority": "-3", "min_priority": ""}
    assert parse_quota(form) == {"rpm": 1000, "tpm": None, "max_concurrent_requests": 4, "token_budget": -1,
                                 "max_adapters": "ten", "max_adapter_bytes": None, "budget_period": "week",
                                 "weight": "0.5", "priority": -3}  # a blank scheduling field stays as it is


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_current_use_reads_without_changing(store, request):
    async def main():
        backend = MemoryBackend() if store == "memory" else RedisBackend(request.getfixturevalue("redis_server").url)
        quotas = QuotaService(backend)
        tenant_id = 900_000 + (store == "redis")
        limits = Limits(rpm=4, tpm=60, max_concurrent_requests=3)  # a token refills each second
        try:
            fresh = await quotas.current_use(tenant_id, limits)
            assert (fresh.num_requests, fresh.num_tokens, fresh.num_concurrent) == (0, 0, 0)
            a = await quotas.admit(tenant_id, limits, 30, "a")
            await quotas.admit(tenant_id, limits, 20, "b")
            await quotas.settle(a, 10)  # 20 tokens refunded, its slot freed
            for _ in range(2):  # reading twice: reading changes nothing
                use = await quotas.current_use(tenant_id, limits)
                assert (use.num_requests, use.num_tokens, use.num_concurrent) == (2, 30, 1)
            unlimited = await quotas.current_use(tenant_id, Limits())
            assert (unlimited.num_requests, unlimited.num_tokens, unlimited.num_concurrent) == (None, None, None)
        finally:
            await quotas.close()

    asyncio.run(main())
