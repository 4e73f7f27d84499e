"""Dependencies, chained as Annotated aliases: API key -> tenant -> quota (and API key -> admin).

Routes get plain values (`Caller`, `QuotaGate`), never ORM objects whose session has closed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Generator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from loraplex.platform import crud
from loraplex.platform.errors import invalid_api_key, permission_denied
from loraplex.platform.gateway import Gateway
from loraplex.platform.models import ApiKey, Tenant, utcnow
from loraplex.platform.quotas.limits import Limits
from loraplex.platform.quotas.service import Ticket

LAST_USED_RESOLUTION = dt.timedelta(minutes=1)  # write last_used_at at most this often per key
bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer lpx-...`")


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def get_db(gw: GatewayDep) -> Generator[Session, None, None]:
    with gw.sessions() as session:
        yield session


# scope="function": the session closes when the route function returns, not when the response is sent;
# a stream would otherwise hold a pooled connection for its whole length (FastAPI >= 0.118 runs a yield
# dependency's exit after the response), and 16 open streams exhausted the pool.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
TokenDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_api_key(session: SessionDep, credentials: TokenDep) -> ApiKey:
    if credentials is None:
        raise invalid_api_key("You didn't provide an API key: send `Authorization: Bearer <key>`.")
    row = crud.find_key(session, credentials.credentials)
    if row is None:
        raise invalid_api_key()
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        row.last_used_at = now
        session.commit()
    return row


ApiKeyDep = Annotated[ApiKey, Depends(get_api_key)]


@dataclass(frozen=True)
class Caller:
    key_id: int
    tenant_id: int
    tenant_name: str


def get_tenant(key: ApiKeyDep, session: SessionDep) -> Tenant:
    if key.role != "tenant" or key.tenant_id is None:
        raise permission_denied("This is an admin key; the /v1 API takes a tenant's key.")
    return session.get(Tenant, key.tenant_id)


TenantDep = Annotated[Tenant, Depends(get_tenant)]


def get_caller(key: ApiKeyDep, tenant: TenantDep) -> Caller:
    return Caller(key.id, tenant.id, tenant.name)


CurrentCaller = Annotated[Caller, Depends(get_caller)]


@dataclass(frozen=True)
class QuotaGate:
    """The caller's quotas; `admit` checks and reserves before anything reaches the engine."""

    gateway: Gateway
    caller: Caller
    limits: Limits
    max_adapters: int | None
    max_adapter_bytes: int | None

    async def admit(self, cost: int, request_id: str) -> Ticket:
        return await self.gateway.quotas.admit(self.caller.tenant_id, self.limits, cost, request_id)


def get_quota(gw: GatewayDep, caller: CurrentCaller, tenant: TenantDep) -> QuotaGate:
    q = tenant.quota  # read on every request: a changed quota holds at once
    return QuotaGate(gw, caller, crud.limits_of(q), q.max_adapters, q.max_adapter_bytes)


TenantQuota = Annotated[QuotaGate, Depends(get_quota)]


def get_admin(key: ApiKeyDep) -> ApiKey:
    if key.role != "admin":
        raise permission_denied("The admin API takes an admin key.")
    return key


AdminKey = Annotated[ApiKey, Depends(get_admin)]
