"""Admin API bodies and their JSON form (the dashboard of issue 7 validates through these too)."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.models import ApiKey, Quota, Tenant, UsageDaily


class QuotaIn(BaseModel):
    """Fields left out stay as they are; null means unlimited."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, ge=0, description="requests per minute")
    tpm: int | None = Field(None, ge=0, description="tokens per minute (prompt + max_tokens reserved)")
    max_concurrent_requests: int | None = Field(None, ge=0)
    token_budget: int | None = Field(None, ge=0, description="tokens per budget_period")
    budget_period: Literal["day", "week", "month"] = "month"
    max_adapters: int | None = Field(None, ge=0)
    max_adapter_bytes: int | None = Field(None, ge=0)


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
    expires_in_s: int | None = Field(None, gt=0)

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


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat() + "Z"


def quota_out(q: Quota) -> dict:
    return {f: getattr(q, f) for f in QuotaIn.model_fields}


def tenant_out(t: Tenant) -> dict:
    return {"id": t.id, "object": "tenant", "name": t.name, "created_at": _iso(t.created_at),
            "quota": quota_out(t.quota)}


def key_out(k: ApiKey) -> dict:
    return {"id": k.id, "object": "api_key", "tenant_id": k.tenant_id, "role": k.role, "name": k.name,
            "prefix": k.prefix, "created_at": _iso(k.created_at), "expires_at": _iso(k.expires_at),
            "revoked_at": _iso(k.revoked_at), "last_used_at": _iso(k.last_used_at)}


def usage_out(u: UsageDaily) -> dict:
    return {"tenant_id": u.tenant_id, "adapter": u.adapter or None, "day": u.day.isoformat(),
            "num_requests": u.num_requests, "num_failed": u.num_failed,
            "num_prompt_tokens": u.num_prompt_tokens, "num_completion_tokens": u.num_completion_tokens}
