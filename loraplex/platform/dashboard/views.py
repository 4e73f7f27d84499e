"""What the dashboard's pages show, read from the roll-ups, the quota store and the engine.

Usage is always read from `usage_daily` (one row per tenant, adapter and UTC day), never from the raw
request log, and every list is read one page at a time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.platform import crud
from loraplex.platform.adapter_names import engine_name
from loraplex.platform.dashboard.charts import Chart, Series, stacked_bars
from loraplex.platform.gateway import Gateway
from loraplex.platform.models import Adapter, ApiKey, Quota, Tenant, UsageDaily
from loraplex.platform.quotas.limits import Limits, budget_period

logger = logging.getLogger(__name__)
MAX_RANGE_DAYS = 366


@dataclass(frozen=True)
class Page:
    number: int  # from 1
    size: int
    total: int

    @property
    def num_pages(self) -> int:
        return max(1, math.ceil(self.total / self.size))

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.size


def page(number: int, size: int, total: int) -> Page:
    """Page `number` clamped into range."""
    return Page(min(max(1, number), max(1, math.ceil(total / size))), size, total)


@dataclass(frozen=True)
class Gauge:
    """`used` of `limit`; used None: unknown (quota store unreachable), limit None: unlimited."""

    used: int | None
    limit: int | None

    @property
    def fraction(self) -> float | None:
        if self.used is None or not self.limit:
            return None
        return min(1.0, self.used / self.limit)


@dataclass(frozen=True)
class Budget:
    used: int
    limit: int
    period: str
    resets_at: dt.datetime  # naive UTC

    @property
    def fraction(self) -> float:
        return min(1.0, self.used / self.limit) if self.limit else 1.0


@dataclass
class TenantSummary:
    id: int
    name: str
    quota: dict
    num_requests: int = 0  # today (UTC)
    num_failed: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    budget: Budget | None = None
    rpm: Gauge = field(default_factory=lambda: Gauge(None, None))
    tpm: Gauge = field(default_factory=lambda: Gauge(None, None))
    concurrent: Gauge = field(default_factory=lambda: Gauge(None, None))

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_completion_tokens


def _quota_dict(q: Quota) -> dict:
    return {f: getattr(q, f) for f in crud.QUOTA_FIELDS}


def summarize(s: Session, tenants: list[Tenant], now: dt.datetime) -> list[TenantSummary]:
    """Today's usage and budget use of `tenants` (blocking; rates come later from `add_rates`)."""
    rows = {t.id: TenantSummary(t.id, t.name, _quota_dict(t.quota)) for t in tenants}
    today = s.execute(
        select(UsageDaily.tenant_id, func.sum(UsageDaily.num_requests), func.sum(UsageDaily.num_failed),
               func.sum(UsageDaily.num_prompt_tokens), func.sum(UsageDaily.num_completion_tokens))
        .where(UsageDaily.tenant_id.in_(rows), UsageDaily.day == now.date()).group_by(UsageDaily.tenant_id))
    for tenant_id, n, failed, prompt, completion in today:
        row = rows[tenant_id]
        row.num_requests, row.num_failed = int(n), int(failed)
        row.num_prompt_tokens, row.num_completion_tokens = int(prompt), int(completion)
    for row in rows.values():
        q = row.quota
        if q["token_budget"] is not None:
            period = budget_period(q["budget_period"], now)
            used = s.scalar(select(func.coalesce(func.sum(UsageDaily.num_prompt_tokens
                                                          + UsageDaily.num_completion_tokens), 0))
                            .where(UsageDaily.tenant_id == row.id, UsageDaily.day >= period.start))
            row.budget = Budget(int(used), q["token_budget"], q["budget_period"], period.end)
    return list(rows.values())


async def add_rates(gw: Gateway, rows: list[TenantSummary]) -> None:
    """Fill in current RPM, TPM and concurrency use from the quota store (unknown if it is down)."""
    for row in rows:
        q = row.quota
        limits = Limits(q["rpm"], q["tpm"], q["max_concurrent_requests"], q["token_budget"], q["budget_period"])
        try:
            use = await gw.quotas.current_use(row.id, limits)
        except Exception as exc:  # the store is unreachable: show the limits, use unknown
            logger.warning("dashboard: cannot read quota use of tenant %d: %s", row.id, exc)
            row.rpm, row.tpm = Gauge(None, q["rpm"]), Gauge(None, q["tpm"])
            row.concurrent = Gauge(None, q["max_concurrent_requests"])
            continue
        row.rpm = Gauge(use.num_requests, q["rpm"])
        row.tpm = Gauge(use.num_tokens, q["tpm"])
        row.concurrent = Gauge(use.num_concurrent, q["max_concurrent_requests"])


# engine -------------------------------------------------------------------------------------------
class Throughput:
    """Generated tokens per second, from the engine's token counter sampled at each panel refresh."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def rate(self, num_generated_tokens: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, num_generated_tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        if now - t0 < 0.5 or num_generated_tokens < n0:
            return None
        return (num_generated_tokens - n0) / (now - t0)


@dataclass(frozen=True)
class Tier:
    """One adapter tier's row. `used` and `capacity` count adapters, or rank rows for the paged slot
    tier ("slots"), which then also reports its resident adapters in `adapters`."""

    name: str
    used: int
    capacity: int | None
    hits: int | None
    misses: int | None
    evictions: int | None
    unit: str = "adapters"
    adapters: int | None = None


@dataclass(frozen=True)
class ShareRow:
    """A tenant's share of the engine now: its rows of the running batch, of all rows running."""

    tenant_id: int | None
    name: str
    num_running: int
    num_waiting: int
    share: float
    weight: float | None


@dataclass(frozen=True)
class EnginePanel:
    model: str
    quota_store: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    tokens_per_s: float | None
    tiers: list[Tier]
    scheduling_policy: str = "fair"
    shares: list[ShareRow] = field(default_factory=list)
    prefix_cache: dict | None = None  # `engine_stats`'s "prefix_cache" (None: caching off)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Tokens found cached over tokens looked up since start (None: caching off or nothing looked up)."""
        c = self.prefix_cache
        return c["num_hit_tokens"] / c["num_query_tokens"] if c and c["num_query_tokens"] else None


async def engine_panel(gw: Gateway, throughput: Throughput) -> tuple[EnginePanel, dict[str, str]]:
    """The panel, and each registered engine adapter's tier (by engine name)."""
    stats = await gw.engine.stats()
    tiers = [Tier(name, t["used"], t["capacity"], t.get("hits"), t.get("misses"), t.get("evictions"),
                  "rank rows" if "page_rows" in t else "adapters", t.get("adapters"))
             for name, t in stats["adapters"]["tiers"].items()]
    panel = EnginePanel(
        model=gw.engine.model_id, quota_store="degraded" if gw.quotas.degraded else "ok",
        num_running=stats["num_running"], num_waiting=stats["num_waiting"],
        max_num_seqs=gw.engine.max_num_seqs, kv_cache_usage=stats["kv_cache_usage"],
        num_kv_blocks=stats["num_kv_blocks"], num_free_kv_blocks=stats["num_free_kv_blocks"],
        num_preemptions=stats["num_preemptions"], tokens_per_s=throughput.rate(stats["num_generated_tokens"]),
        tiers=tiers, scheduling_policy=stats["scheduling_policy"], shares=await share_rows(gw, stats["tenants"]),
        prefix_cache=stats["prefix_cache"] if stats["prefix_cache"]["enabled"] else None)
    return panel, stats["adapters"]["adapters"]


async def share_rows(gw: Gateway, tenants: dict) -> list[ShareRow]:
    """The tenants with requests in the engine now, the largest share first, named from the database."""
    active = {k: t for k, t in tenants.items() if t["num_running"] or t["num_waiting"]}
    ids = [k for k in active if k is not None]

    def names() -> dict[int, str]:
        with gw.sessions() as s:
            return dict(s.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).all()) if ids else {}

    named = await asyncio.to_thread(names)
    total = sum(t["num_running"] for t in active.values()) or 1
    rows = [ShareRow(k, "(no tenant)" if k is None else named.get(k, f"tenant {k} (deleted)"), t["num_running"],
                     t["num_waiting"], t["num_running"] / total, t["weight"]) for k, t in active.items()]
    return sorted(rows, key=lambda r: (-r.share, -r.num_waiting, r.name))


# a tenant's page ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterRow:
    name: str
    rank: int
    target_modules: list[str]
    num_bytes: int
    tier: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None


def key_state(k: ApiKey, now: dt.datetime) -> str:
    if k.revoked_at is not None:
        return "revoked"
    if k.expires_at is not None and k.expires_at <= now:
        return "expired"
    return "active"


def list_keys(s: Session, tenant_id: int, number: int, size: int) -> tuple[list[ApiKey], Page]:
    """A tenant's keys, newest first."""
    total = s.scalar(select(func.count()).where(ApiKey.tenant_id == tenant_id))
    p = page(number, size, int(total))
    rows = s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id.desc())
                     .offset(p.offset).limit(size)).all()
    return list(rows), p


def list_adapters(s: Session, tenant_id: int, number: int, size: int) -> tuple[list[Adapter], Page]:
    total = s.scalar(select(func.count()).where(Adapter.tenant_id == tenant_id))
    p = page(number, size, int(total))
    rows = s.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.name)
                     .offset(p.offset).limit(size)).all()
    return list(rows), p


def adapter_rows(adapters: list[Adapter], tiers: dict[str, str]) -> list[AdapterRow]:
    """`tiers`: engine name -> tier; an adapter this process never loaded is on disk."""
    return [AdapterRow(a.name, a.rank, list(a.target_modules), a.num_bytes,
                       tiers.get(engine_name(a.tenant_id, a.name, a.digest), "disk"), a.created_at,
                       a.last_used_at) for a in adapters]


def usage_range(start: dt.date | None, end: dt.date | None, today: dt.date,
                default_days: int = 14) -> tuple[dt.date, dt.date]:
    """The chosen days, oldest first and inclusive, at most MAX_RANGE_DAYS long."""
    end = end or today
    start = start or end - dt.timedelta(days=default_days - 1)
    if start > end:
        start, end = end, start
    return max(start, end - dt.timedelta(days=MAX_RANGE_DAYS - 1)), end


def usage_charts(s: Session, tenant_id: int, start: dt.date, end: dt.date) -> tuple[Chart, Chart]:
    """Tokens per day (prompt, completion) and requests per day (succeeded, failed), summed over the
    tenant's adapters from the daily roll-ups."""
    per_day = {day: (int(p), int(c), int(n), int(f)) for day, p, c, n, f in s.execute(
        select(UsageDaily.day, func.sum(UsageDaily.num_prompt_tokens), func.sum(UsageDaily.num_completion_tokens),
               func.sum(UsageDaily.num_requests), func.sum(UsageDaily.num_failed))
        .where(UsageDaily.tenant_id == tenant_id, UsageDaily.day >= start, UsageDaily.day <= end)
        .group_by(UsageDaily.day))}
    days = [start + dt.timedelta(days=i) for i in range((end - start).days + 1)]
    p, c, n, f = ([per_day.get(d, (0, 0, 0, 0))[i] for d in days] for i in range(4))
    tokens = stacked_bars("Tokens per day", days, [Series("prompt tokens", "s-prompt", p),
                                                     Series("completion tokens", "s-completion", c)])
    requests = stacked_bars("Requests per day", days, [Series("succeeded", "s-ok", [a - b for a, b in zip(n, f, strict=True)]),
                                                         Series("failed", "s-error", f)])
    return tokens, requests
