"""Dependencies, chained as Annotated aliases: API key -> tenant -> quota (and API key -> admin).

Authentication reads the key, its tenant and quota in one short database session and returns plain
values (`Identity`, `Caller`, `QuotaGate`): no connection is held while a request generates, however
long, so the pool never limits how many requests are in flight. A changed quota or a revoked key holds
from the next request on.
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
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.errors import invalid_api_key, permission_denied
from loraplex.platform.gateway import Gateway
from loraplex.platform.metrics import Metrics
from loraplex.platform.models import Tenant, utcnow
from loraplex.platform.quotas.limits import Limits
from loraplex.platform.quotas.service import QuotaService, Ticket

LAST_USED_RESOLUTION = dt.timedelta(minutes=1)  # write last_used_at at most this often per key
bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer lpx-...`")


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


# The narrow parts a route takes, instead of the whole Gateway (full-stack-fastapi-template's habit).
def get_engine(gw: GatewayDep) -> EngineClient:
    return gw.engine


def get_quotas(gw: GatewayDep) -> QuotaService:
    return gw.quotas


def get_metrics(gw: GatewayDep) -> Metrics:
    return gw.metrics


def get_started_at(gw: GatewayDep) -> int:
    return gw.started_at


EngineDep = Annotated[EngineClient, Depends(get_engine)]
QuotasDep = Annotated[QuotaService, Depends(get_quotas)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
StartedAtDep = Annotated[int, Depends(get_started_at)]  # when this gateway started, Unix seconds


def get_db(gw: GatewayDep) -> Generator[Session, None, None]:
    with gw.sessions() as session:
        yield session


# scope="function": the session closes when the route function returns, not when the response is sent;
# a stream would otherwise hold a pooled connection for its whole length (FastAPI >= 0.118 runs a yield
# dependency's exit after the response), and 16 open streams exhausted the pool.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
TokenDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


@dataclass(frozen=True)
class Identity:
    """An active API key and, for a tenant's key, its tenant and quota as they were read."""

    key_id: int
    role: str  # "tenant" or "admin"
    tenant_id: int | None = None
    tenant_name: str = ""
    limits: Limits | None = None
    max_adapters: int | None = None
    max_adapter_bytes: int | None = None


def get_identity(gw: GatewayDep, credentials: TokenDep) -> Identity:
    if credentials is None:
        raise invalid_api_key("You didn't provide an API key: send `Authorization: Bearer <key>`.")
    with gw.sessions() as session:
        row = crud.find_key(session, credentials.credentials)
        if row is None:
            raise invalid_api_key()
        now = utcnow()
        if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
            row.last_used_at = now
            session.commit()
        if row.role != "tenant" or row.tenant_id is None:
            return Identity(row.id, row.role)
        tenant = session.get(Tenant, row.tenant_id)
        if tenant is None:  # deleted between the two reads
            raise invalid_api_key()
        q = tenant.quota
        return Identity(row.id, row.role, tenant.id, tenant.name, crud.limits_of(q), q.max_adapters,
                        q.max_adapter_bytes)


ApiKeyDep = Annotated[Identity, Depends(get_identity)]


@dataclass(frozen=True)
class Caller:
    key_id: int
    tenant_id: int
    tenant_name: str


def get_caller(key: ApiKeyDep) -> Caller:
    if key.role != "tenant" or key.tenant_id is None:
        raise permission_denied("This is an admin key; the /v1 API takes a tenant's key.")
    return Caller(key.key_id, key.tenant_id, key.tenant_name)


CurrentCaller = Annotated[Caller, Depends(get_caller)]


@dataclass(frozen=True)
class QuotaGate:
    """The caller's quotas; `admit` checks and reserves before anything reaches the engine."""

    gateway: Gateway
    caller: Caller
    limits: Limits
    max_adapters: int | None
    max_adapter_bytes: int | None

    async def admit(self, cost: int, request_id: str, num_sequences: int = 1, sequences_param: str = "n") -> Ticket:
        return await self.gateway.quotas.admit(self.caller.tenant_id, self.limits, cost, request_id,
                                               num_sequences, sequences_param)


def get_quota(gw: GatewayDep, caller: CurrentCaller, key: ApiKeyDep) -> QuotaGate:
    return QuotaGate(gw, caller, key.limits, key.max_adapters, key.max_adapter_bytes)


TenantQuota = Annotated[QuotaGate, Depends(get_quota)]


def get_admin(key: ApiKeyDep) -> Identity:
    if key.role != "admin":
        raise permission_denied("The admin API takes an admin key.")
    return key


AdminKey = Annotated[Identity, Depends(get_admin)]
