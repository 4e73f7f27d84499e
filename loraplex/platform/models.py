"""The gateway's tables (SQLAlchemy 2). The schema changes only through Alembic (`migrations/`).

Times are naive UTC (`utcnow()`), the same on SQLite and PostgreSQL. Usage has two tables: the raw
log, one row per request, and `usage_daily`, rolled up per tenant, adapter and day in the same
transaction, which is what every usage query reads. Usage keeps `tenant_id` without a foreign key so
that deleting a tenant keeps its history.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

BigId = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"
    # ids are never reused (SQLite otherwise hands a deleted tenant's id to the next one, which then
    # inherited its usage, budget and rate-limit state; PostgreSQL's sequences never reuse): migration 0004
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(), default=utcnow)

    quota: Mapped[Quota] = relationship(back_populates="tenant", cascade="all, delete-orphan", uselist=False)
    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", cascade="all, delete-orphan")
    adapters: Mapped[list[Adapter]] = relationship(back_populates="tenant", cascade="all, delete-orphan")


class ApiKey(Base):
    """role "admin" (tenant_id NULL) or "tenant". The key itself is never stored, only its sha256."""

    __tablename__ = "api_keys"
    __table_args__ = {"sqlite_autoincrement": True}  # as tenants': usage rows name the key's id

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime())
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime())

    tenant: Mapped[Tenant | None] = relationship(back_populates="keys")


class AdminSession(Base):
    """A signed-in dashboard session (issue 7). The cookie holds a random token; only its sha256 is kept.
    It lives no longer than its admin key: revoking the key ends its sessions."""

    __tablename__ = "admin_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime())


class Quota(Base):
    """One row per tenant; NULL means unlimited."""

    __tablename__ = "quotas"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    rpm: Mapped[int | None] = mapped_column(Integer())
    tpm: Mapped[int | None] = mapped_column(Integer())
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer())
    token_budget: Mapped[int | None] = mapped_column(BigInteger())
    budget_period: Mapped[str] = mapped_column(String(8), default="month")
    max_adapters: Mapped[int | None] = mapped_column(Integer())
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger())
    # scheduling, not limits: fair-share weight, the default priority and the most urgent one allowed
    weight: Mapped[float] = mapped_column(Float(), default=1.0, server_default="1.0")
    priority: Mapped[int] = mapped_column(Integer(), default=0, server_default="0")
    min_priority: Mapped[int] = mapped_column(Integer(), default=0, server_default="0")

    tenant: Mapped[Tenant] = relationship(back_populates="quota")


class Adapter(Base):
    """A tenant's adapter. `digest` is its files' `loraplex.adapters.store.content_digest`; they are the
    AdapterStore entry `adapter_names.store_name` of owner `adapter_names.store_owner`."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64), index=True)
    num_bytes: Mapped[int] = mapped_column(BigInteger())
    rank: Mapped[int] = mapped_column(Integer())
    target_modules: Mapped[list] = mapped_column(JSON(), default=list)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(), default=utcnow)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime())

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")


class UsageRecord(Base):
    """One row per request. status: ok, aborted (client left), error."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[int] = mapped_column(Integer())
    api_key_id: Mapped[int | None] = mapped_column(Integer())
    adapter: Mapped[str | None] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    num_prompt_tokens: Mapped[int] = mapped_column(Integer(), default=0)
    num_completion_tokens: Mapped[int] = mapped_column(Integer(), default=0)
    ttft_s: Mapped[float | None] = mapped_column(Float())
    latency_s: Mapped[float | None] = mapped_column(Float())
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(), default=utcnow)


class UsageDaily(Base):
    """Roll-up of usage_records per (tenant, adapter, UTC day); adapter "" is the base model."""

    __tablename__ = "usage_daily"

    tenant_id: Mapped[int] = mapped_column(Integer(), primary_key=True)
    adapter: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date(), primary_key=True)
    num_requests: Mapped[int] = mapped_column(BigInteger(), default=0)
    num_failed: Mapped[int] = mapped_column(BigInteger(), default=0)
    num_prompt_tokens: Mapped[int] = mapped_column(BigInteger(), default=0)
    num_completion_tokens: Mapped[int] = mapped_column(BigInteger(), default=0)
