"""Database operations shared by the API routes, `loraplex serve` and the admin dashboard (issue 7).
Functions take a Session and leave committing to the caller unless they say otherwise."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.platform import security
from loraplex.platform.config import QuotaDefaults
from loraplex.platform.models import Adapter, ApiKey, Quota, Tenant, UsageDaily, utcnow
from loraplex.platform.quotas.limits import Limits

QUOTA_FIELDS = ("rpm", "tpm", "max_concurrent_requests", "token_budget", "budget_period", "max_adapters",
                "max_adapter_bytes", "weight", "priority", "min_priority")


# tenants ----------------------------------------------------------------------------------------
def create_tenant(s: Session, name: str, defaults: QuotaDefaults, quota: dict | None = None) -> Tenant:
    tenant = Tenant(name=name)
    values = {f: getattr(defaults, f) for f in QUOTA_FIELDS} | (quota or {})
    tenant.quota = Quota(**values)
    s.add(tenant)
    s.flush()
    return tenant


def list_tenants(s: Session, offset: int = 0, limit: int = 100) -> tuple[list[Tenant], int]:
    total = s.scalar(select(func.count()).select_from(Tenant))
    rows = s.scalars(select(Tenant).order_by(Tenant.id).offset(offset).limit(limit)).all()
    return list(rows), int(total)


def get_tenant_by_name(s: Session, name: str) -> Tenant | None:
    return s.scalar(select(Tenant).where(Tenant.name == name))


# keys -------------------------------------------------------------------------------------------
def issue_key(s: Session, tenant: Tenant | None, name: str = "", expires_at: dt.datetime | None = None,
              key: str | None = None) -> tuple[ApiKey, str]:
    """A new key for `tenant` (None: an admin key). Returns the row and the key, which is never stored."""
    key = key or security.new_key()
    row = ApiKey(tenant_id=tenant.id if tenant else None, role="tenant" if tenant else "admin", name=name,
                 prefix=security.key_prefix(key), key_hash=security.hash_key(key), expires_at=expires_at)
    s.add(row)
    s.flush()
    return row, key


def find_key(s: Session, key: str) -> ApiKey | None:
    """The active key row matching `key` (not revoked, not expired), else None."""
    if not key.startswith(security.KEY_PREFIX) or len(key) > 256:
        return None
    digest = security.hash_key(key)
    row = s.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
    if row is None or not security.matches(key, row.key_hash) or row.revoked_at is not None:
        return None
    if row.expires_at is not None and row.expires_at <= utcnow():
        return None
    return row


def revoke_key(s: Session, row: ApiKey) -> None:
    if row.revoked_at is None:
        row.revoked_at = utcnow()


def list_keys(s: Session, tenant_id: int | None) -> list[ApiKey]:
    where = ApiKey.tenant_id.is_(None) if tenant_id is None else ApiKey.tenant_id == tenant_id
    return list(s.scalars(select(ApiKey).where(where).order_by(ApiKey.id)).all())


def ensure_admin_key(s: Session, key: str | None) -> str | None:
    """First start: make sure an admin key exists. With `key` (LORAPLEX_ADMIN_KEY) store its hash if it
    is new; without, create a key when there is no active admin key. Returns a key created here (to
    print once), else None. Commits."""
    created = None
    if key is not None:
        if s.scalar(select(ApiKey).where(ApiKey.key_hash == security.hash_key(key))) is None:
            issue_key(s, None, name="LORAPLEX_ADMIN_KEY", key=key)
    else:
        active = select(ApiKey).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None))
        if s.scalar(active.limit(1)) is None:
            _, created = issue_key(s, None, name="first start")
    s.commit()
    return created


# quotas -----------------------------------------------------------------------------------------
def limits_of(quota: Quota) -> Limits:
    return Limits(rpm=quota.rpm, tpm=quota.tpm, max_concurrent_requests=quota.max_concurrent_requests,
                  token_budget=quota.token_budget, budget_period=quota.budget_period)


def update_quota(s: Session, tenant: Tenant, values: dict) -> Quota:
    for f, v in values.items():
        if f not in QUOTA_FIELDS:
            raise KeyError(f)
        setattr(tenant.quota, f, v)
    s.flush()
    return tenant.quota


# adapters ---------------------------------------------------------------------------------------
def get_adapter(s: Session, tenant_id: int, name: str) -> Adapter | None:
    return s.scalar(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))


def list_adapters(s: Session, tenant_id: int) -> list[Adapter]:
    return list(s.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.id)).all())


def adapter_totals(s: Session, tenant_id: int) -> tuple[int, int]:
    """(number of adapters, their bytes) of a tenant."""
    n, size = s.execute(select(func.count(), func.coalesce(func.sum(Adapter.num_bytes), 0))
                        .where(Adapter.tenant_id == tenant_id)).one()
    return int(n), int(size)


def adapters_with_digest(s: Session, digest: str) -> list[Adapter]:
    return list(s.scalars(select(Adapter).where(Adapter.digest == digest).order_by(Adapter.id)).all())


# usage ------------------------------------------------------------------------------------------
def usage_rows(s: Session, *, tenant_id: int | None = None, adapter: str | None = None,
               start: dt.date | None = None, end: dt.date | None = None, offset: int = 0,
               limit: int = 1000) -> tuple[list[UsageDaily], int]:
    """Daily roll-ups, newest day first; `end` inclusive. Never reads the raw request log."""
    q = select(UsageDaily)
    if tenant_id is not None:
        q = q.where(UsageDaily.tenant_id == tenant_id)
    if adapter is not None:
        q = q.where(UsageDaily.adapter == adapter)
    if start is not None:
        q = q.where(UsageDaily.day >= start)
    if end is not None:
        q = q.where(UsageDaily.day <= end)
    total = s.scalar(select(func.count()).select_from(q.subquery()))
    rows = s.scalars(q.order_by(UsageDaily.day.desc(), UsageDaily.tenant_id, UsageDaily.adapter)
                     .offset(offset).limit(limit)).all()
    return list(rows), int(total)
