"""Admin API bodies, in and out (pydantic, so `/docs` shows the real shapes); the dashboard validates its
forms through the same input models. Times out are UTC ISO 8601 strings ending in Z."""

from __future__ import annotations

import datetime as dt
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.engine.sampling_params import PRIORITY_MAX, PRIORITY_MIN
from loraplex.platform.models import ApiKey, Quota, Tenant, UsageDaily

MAX_WEIGHT = 1e6
# A weight's floor, as far below 1 as MAX_WEIGHT is above it: the fair-share counter grows by tokens / weight,
# and a weight of 1e-320 took every active tenant's counter to +inf (a returning tenant starts level with
# the least-served one), which turned fair ordering off.
MIN_WEIGHT = 1e-6
# The largest integer a database column holds (SQLite's INTEGER, PostgreSQL's BIGINT): a larger count, id or
# offset is refused with a 400 naming it instead of overflowing in the driver as a 500.
MAX_INT = 2**63 - 1
# expires_in_s: a century, well inside datetime's range (a larger value overflowed it as a 500)
MAX_EXPIRES_IN_S = 100 * 365 * 86400


class QuotaIn(BaseModel):
    """Fields left out stay as they are; null means unlimited. weight, priority and min_priority are the
    scheduler's (`loraplex.engine.fair_share`), never null: the tenant's fair-share weight, the priority
    of its requests that name none, and the most urgent (lowest) priority a request of it may name."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, ge=0, le=MAX_INT, description="requests per minute")
    tpm: int | None = Field(None, ge=0, le=MAX_INT, description="tokens per minute (prompt + max_tokens reserved)")
    max_concurrent_requests: int | None = Field(None, ge=0, le=MAX_INT)
    token_budget: int | None = Field(None, ge=0, le=MAX_INT, description="tokens per budget_period")
    budget_period: Literal["day", "week", "month"] = "month"
    max_adapters: int | None = Field(None, ge=0, le=MAX_INT)
    max_adapter_bytes: int | None = Field(None, ge=0, le=MAX_INT)
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False,
                          description="fair-share weight: the tenant's share of the engine against others")
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="default priority (lower runs first)")
    min_priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX,
                              description="the most urgent priority a request may ask for")


class TenantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    quota: QuotaIn | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=128)
    expires_at: dt.datetime | None = Field(None, description="UTC; or give expires_in_s")
    expires_in_s: int | None = Field(None, gt=0, le=MAX_EXPIRES_IN_S)

    @model_validator(mode="after")
    def _one_expiry(self):
        if self.expires_at is not None and self.expires_in_s is not None:
            raise ValueError("give expires_at or expires_in_s, not both")
        return self

    def expiry(self, now: dt.datetime) -> dt.datetime | None:
        if self.expires_in_s is not None:
            return now + dt.timedelta(seconds=self.expires_in_s)
        if self.expires_at is not None and self.expires_at.tzinfo is not None:
            return self.expires_at.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return self.expires_at


class QuotaOut(BaseModel):
    """A tenant's quota; null is unlimited (fields as in `QuotaIn`)."""

    rpm: int | None
    tpm: int | None
    max_concurrent_requests: int | None
    token_budget: int | None
    budget_period: Literal["day", "week", "month"]
    max_adapters: int | None
    max_adapter_bytes: int | None
    weight: float
    priority: int
    min_priority: int


class TenantOut(BaseModel):
    id: int
    object: Literal["tenant"] = "tenant"
    name: str
    created_at: str
    quota: QuotaOut


class KeyOut(BaseModel):
    """An API key as stored: its prefix (the first characters, to recognize it), never the key."""

    id: int
    object: Literal["api_key"] = "api_key"
    tenant_id: int | None
    role: Literal["tenant", "admin"]
    name: str
    prefix: str
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    last_used_at: str | None


class KeyCreated(KeyOut):
    key: str  # the key itself: in this response only


class UsageOut(BaseModel):
    """One tenant's requests and tokens on one adapter (null: the base model) on one UTC day."""

    tenant_id: int
    adapter: str | None
    day: str
    num_requests: int
    num_failed: int
    num_prompt_tokens: int
    num_completion_tokens: int


class TenantEngineOut(BaseModel):
    """One tenant in the engine (`Scheduler.tenant_stats`): requests now, tokens computed since start, and
    under the "fair" policy its fair-share counter (weighted tokens over weight) and weight."""

    tenant_id: int | None
    num_waiting: int
    num_running: int
    num_prompt_tokens: int
    num_output_tokens: int
    counter: float | None
    weight: float | None


class PrefixCacheOut(BaseModel):
    """Prefix caching since start: tokens of admitted requests looked up and found (their KV blocks reused),
    blocks held now (in use or evictable) and cached blocks evicted for other tokens."""

    enabled: bool
    num_query_tokens: int
    num_hit_tokens: int
    num_cached_blocks: int
    num_evicted_blocks: int


class EngineOut(BaseModel):
    """The engine's state: requests, KV cache blocks (usage 0..1), counters since start, the scheduling
    policy, the prefix cache, each tenant seen (`tenants`), and `adapters` (`AdapterManager.adapter_stats`:
    per tier capacity, occupancy, hits, misses, evictions, load times, and each adapter's tier under its
    engine name)."""

    model: str
    quota_store: Literal["ok", "degraded"]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int
    num_batched_rows: int
    num_generated_tokens: int
    num_preemptions: int
    scheduling_policy: Literal["fair", "fcfs"]
    prefix_cache: PrefixCacheOut
    tenants: list[TenantEngineOut]
    adapters: dict


T = TypeVar("T")


class ObjectList(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]


class Page(ObjectList[T], Generic[T]):
    """`data` from `offset` on, at most `limit` entries, of `total`."""

    total: int


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat() + "Z"


def quota_out(q: Quota) -> QuotaOut:
    return QuotaOut(**{f: getattr(q, f) for f in QuotaIn.model_fields})


def tenant_out(t: Tenant) -> TenantOut:
    return TenantOut(id=t.id, name=t.name, created_at=_iso(t.created_at), quota=quota_out(t.quota))


def key_out(k: ApiKey) -> KeyOut:
    return KeyOut(id=k.id, tenant_id=k.tenant_id, role=k.role, name=k.name, prefix=k.prefix,
                  created_at=_iso(k.created_at), expires_at=_iso(k.expires_at), revoked_at=_iso(k.revoked_at),
                  last_used_at=_iso(k.last_used_at))


def usage_out(u: UsageDaily) -> UsageOut:
    return UsageOut(tenant_id=u.tenant_id, adapter=u.adapter or None, day=u.day.isoformat(),
                    num_requests=u.num_requests, num_failed=u.num_failed, num_prompt_tokens=u.num_prompt_tokens,
                    num_completion_tokens=u.num_completion_tokens)
