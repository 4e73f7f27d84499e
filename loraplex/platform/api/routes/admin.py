"""/admin: tenants, keys, quotas, adapters, usage and engine state. Admin keys only.

Lists are paged (`offset`, `limit`, `total`); usage reads the daily roll-ups, never the request log.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Path, Query
from sqlalchemy.exc import IntegrityError

from loraplex.platform import crud
from loraplex.platform.admin_schemas import (
    MAX_INT,
    EngineOut,
    KeyCreated,
    KeyIn,
    KeyOut,
    ObjectList,
    Page,
    QuotaIn,
    QuotaOut,
    TenantEngineOut,
    TenantIn,
    TenantOut,
    TenantPatch,
    UsageOut,
    key_out,
    quota_out,
    tenant_out,
    usage_out,
)
from loraplex.platform.api.deps import (
    AdminKey,
    EngineDep,
    QuotaDefaultsDep,
    QuotasDep,
    SessionDep,
    SessionsDep,
    TenantAdaptersDep,
)
from loraplex.platform.errors import conflict, invalid_request, not_found
from loraplex.platform.models import ApiKey, Tenant, utcnow
from loraplex.platform.openai_responses import AdapterCard, Deleted
from loraplex.platform.tenant_adapters import adapter_card

router = APIRouter(prefix="/admin", tags=["admin"])
Offset = Query(0, ge=0, le=MAX_INT)
# A row id in a path: past MAX_INT no row has it, and the driver would overflow (a 500) looking for it
RowId = Annotated[int, Path(le=MAX_INT)]
Limit = Query(100, ge=1, le=1000)


def _tenant(session, tenant_id: int) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise not_found(f"Tenant {tenant_id} does not exist.", param="tenant_id")
    return tenant


# tenants ----------------------------------------------------------------------------------------
@router.post("/tenants", status_code=201)
def create_tenant(body: TenantIn, defaults: QuotaDefaultsDep, session: SessionDep, _: AdminKey) -> TenantOut:
    quota = body.quota.model_dump(exclude_unset=True) if body.quota else None
    try:
        tenant = crud.create_tenant(session, body.name, defaults, quota)
        _check_priorities(tenant.quota)
        session.commit()
    except IntegrityError:
        raise conflict(f"A tenant named `{body.name}` exists.", param="name") from None
    return tenant_out(tenant)


@router.get("/tenants")
def list_tenants(session: SessionDep, _: AdminKey, offset: int = Offset, limit: int = Limit) -> Page[TenantOut]:
    tenants, total = crud.list_tenants(session, offset, limit)
    return Page(data=[tenant_out(t) for t in tenants], total=total)


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: RowId, session: SessionDep, _: AdminKey) -> TenantOut:
    return tenant_out(_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: RowId, body: TenantPatch, session: SessionDep, _: AdminKey) -> TenantOut:
    tenant = _tenant(session, tenant_id)
    tenant.name = body.name
    try:
        session.commit()
    except IntegrityError:
        raise conflict(f"A tenant named `{body.name}` exists.", param="name") from None
    return tenant_out(tenant)


@router.delete("/tenants/{tenant_id}")
async def delete_tenant(tenant_id: RowId, sessions: SessionsDep, adapters: TenantAdaptersDep, _: AdminKey) -> Deleted:
    """Revokes its keys at once (they are deleted), unloads its adapters, keeps its usage history."""

    def names() -> list[str]:
        with sessions() as s:
            return [a.name for a in crud.list_adapters(s, _tenant(s, tenant_id).id)]

    for name in await asyncio.to_thread(names):
        await adapters.delete(tenant_id, name)

    def delete() -> None:
        with sessions.begin() as s:
            s.delete(_tenant(s, tenant_id))

    await asyncio.to_thread(delete)
    return Deleted(id=tenant_id, object="tenant")


# quotas -----------------------------------------------------------------------------------------
@router.get("/tenants/{tenant_id}/quota")
def get_quota(tenant_id: RowId, session: SessionDep, _: AdminKey) -> QuotaOut:
    return quota_out(_tenant(session, tenant_id).quota)


@router.patch("/tenants/{tenant_id}/quota")
def set_quota(tenant_id: RowId, body: QuotaIn, session: SessionDep, _: AdminKey) -> QuotaOut:
    """Set the given quota fields (null: unlimited); effective for the tenant's next request."""
    quota = crud.update_quota(session, _tenant(session, tenant_id), body.model_dump(exclude_unset=True))
    _check_priorities(quota)
    session.commit()
    return quota_out(quota)


def _check_priorities(quota) -> None:
    """400 (nothing saved) for a default priority more urgent than the tenant's min_priority: its requests
    that name none would run at a priority that those naming it are refused."""
    if quota.priority < quota.min_priority:
        raise invalid_request(f"priority {quota.priority} is more urgent than min_priority {quota.min_priority}: a "
                              "tenant's default priority must be one its requests may ask for (lower runs first).",
                              param="priority")


# keys -------------------------------------------------------------------------------------------
@router.post("/tenants/{tenant_id}/keys", status_code=201)
def issue_key(tenant_id: RowId, body: KeyIn, session: SessionDep, _: AdminKey) -> KeyCreated:
    """The key is in this response only; the server keeps its hash."""
    row, key = crud.issue_key(session, _tenant(session, tenant_id), body.name, body.expiry(utcnow()))
    session.commit()
    return KeyCreated(**key_out(row).model_dump(), key=key)


@router.get("/tenants/{tenant_id}/keys")
def list_keys(tenant_id: RowId, session: SessionDep, _: AdminKey) -> ObjectList[KeyOut]:
    _tenant(session, tenant_id)
    return ObjectList(data=[key_out(k) for k in crud.list_keys(session, tenant_id)])


@router.delete("/keys/{key_id}")
def revoke_key(key_id: RowId, session: SessionDep, _: AdminKey) -> KeyOut:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found(f"Key {key_id} does not exist.", param="key_id")
    crud.revoke_key(session, row)
    session.commit()
    return key_out(row)


# adapters ---------------------------------------------------------------------------------------
@router.get("/tenants/{tenant_id}/adapters")
def list_adapters(tenant_id: RowId, engine: EngineDep, session: SessionDep, _: AdminKey) -> ObjectList[AdapterCard]:
    rows = crud.list_adapters(session, _tenant(session, tenant_id).id)
    return ObjectList(data=[adapter_card(engine.model_id, r) for r in rows])


@router.delete("/tenants/{tenant_id}/adapters/{name}")
async def delete_adapter(tenant_id: RowId, name: str, adapters: TenantAdaptersDep, _: AdminKey) -> Deleted:
    await adapters.delete(tenant_id, name)
    return Deleted(id=name, object="adapter")


# usage and engine -------------------------------------------------------------------------------
@router.get("/usage")
def usage(session: SessionDep, _: AdminKey, tenant_id: Annotated[int | None, Query(le=MAX_INT)] = None, adapter: str | None = None,
          start: dt.date | None = None, end: dt.date | None = None, offset: int = Offset,
          limit: int = Limit) -> Page[UsageOut]:
    """Requests and tokens per tenant, adapter ("" or null: the base model) and UTC day, newest first."""
    adapter_key = None if adapter is None else ("" if adapter in ("", "base") else adapter)
    rows, total = crud.usage_rows(session, tenant_id=tenant_id, adapter=adapter_key, start=start, end=end,
                                  offset=offset, limit=limit)
    return Page(data=[usage_out(r) for r in rows], total=total)


@router.get("/engine")
async def engine_state(engine: EngineDep, quotas: QuotasDep, _: AdminKey) -> EngineOut:
    stats = await engine.stats()
    tenants = [TenantEngineOut(tenant_id=k, **t) for k, t in stats.pop("tenants").items()]
    return EngineOut(model=engine.model_id, quota_store="degraded" if quotas.degraded else "ok", tenants=tenants,
                     **stats)
