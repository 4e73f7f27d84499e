"""Dependencies, chained as Annotated aliases: API key -> tenant -> quota (and API key -> admin), and
the gateway's parts a route takes (engine client, completion service, tenant adapters, sessions...),
never the whole `Gateway` (full-stack-fastapi-template's habit; only the dashboard, which shows all of
it, takes the gateway).

Authentication reads the key, its tenant and quota in one short database session and returns plain
values (`Identity`, `Caller`, `QuotaGate`): no connection is held while a request generates, however
long, so the pool never limits how many requests are in flight. For a completion the same session also
reads what the body's `model` names (`ModelCall`). A changed quota or a revoked key holds from the next
request on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform import crud
from loraplex.platform.completion import Completions
from loraplex.platform.config import QuotaDefaults, Settings
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.errors import invalid_api_key, permission_denied
from loraplex.platform.gateway import Gateway
from loraplex.platform.lifecycle import Lifecycle
from loraplex.platform.metrics import Metrics
from loraplex.platform.models import Tenant, utcnow
from loraplex.platform.quotas.limits import Limits
from loraplex.platform.quotas.service import QuotaService, Ticket
from loraplex.platform.tenant_adapters import Target, TenantAdapters

LAST_USED_RESOLUTION = dt.timedelta(minutes=1)  # write last_used_at at most this often per key
bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer lpx-...`")


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def part(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency giving the gateway's attribute `name`: the narrow parts a route takes, instead of the
    whole Gateway (full-stack-fastapi-template's habit)."""

    async def get(request: Request) -> Any:  # async: no trip through the thread pool
        return getattr(request.app.state.gateway, name)

    get.__name__ = f"get_{name}"
    return get


EngineDep = Annotated[EngineClient, Depends(part("engine"))]
QuotasDep = Annotated[QuotaService, Depends(part("quotas"))]
MetricsDep = Annotated[Metrics, Depends(part("metrics"))]
StartedAtDep = Annotated[int, Depends(part("started_at"))]  # when this gateway started, Unix seconds
SessionsDep = Annotated[sessionmaker[Session], Depends(part("sessions"))]  # for work a route runs in threads
CompletionsDep = Annotated[Completions, Depends(part("completions"))]
TenantAdaptersDep = Annotated[TenantAdapters, Depends(part("adapters"))]
LifecycleDep = Annotated[Lifecycle, Depends(part("lifecycle"))]
QuotaDefaultsDep = Annotated[QuotaDefaults, Depends(part("quota_defaults"))]
SettingsDep = Annotated[Settings, Depends(part("settings"))]


def get_db(sessions: SessionsDep) -> Generator[Session, None, None]:
    with sessions() as session:
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
    share: Share | None = None


@dataclass(frozen=True)
class Share:
    """A tenant's scheduling fields (its quota's): fair-share weight, default and most urgent priority."""

    weight: float = 1.0
    priority: int = 0
    min_priority: int = 0


def authenticate(session: Session, credentials: HTTPAuthorizationCredentials | None) -> Identity:
    """The active key of `credentials`, read in `session` (its last use is written at most once a
    minute). Raises 401 `invalid_api_key` for a missing, unknown, revoked or expired key."""
    if credentials is None:
        raise invalid_api_key("You didn't provide an API key: send `Authorization: Bearer <key>`.")
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
                    q.max_adapter_bytes, Share(q.weight, q.priority, q.min_priority))


def get_identity(sessions: SessionsDep, credentials: TokenDep) -> Identity:
    with sessions() as session:
        return authenticate(session, credentials)


ApiKeyDep = Annotated[Identity, Depends(get_identity)]


@dataclass(frozen=True)
class Caller:
    key_id: int
    tenant_id: int
    tenant_name: str
    share: Share = Share()


def get_caller(key: ApiKeyDep) -> Caller:
    return caller_of(key)


def caller_of(key: Identity) -> Caller:
    """The tenant behind `key`; 403 `permission_denied` for an admin key."""
    if key.role != "tenant" or key.tenant_id is None:
        raise permission_denied("This is an admin key; the /v1 API takes a tenant's key.")
    return Caller(key.key_id, key.tenant_id, key.tenant_name, key.share or Share())


CurrentCaller = Annotated[Caller, Depends(get_caller)]


@dataclass(frozen=True)
class QuotaGate:
    """The caller's quotas; `admit` checks and reserves before anything reaches the engine."""

    quotas: QuotaService
    caller: Caller
    limits: Limits
    max_adapters: int | None
    max_adapter_bytes: int | None

    @classmethod
    def of(cls, quotas: QuotaService, caller: Caller, key: Identity) -> QuotaGate:
        """The gate of `caller`, with the quota read with its `key`."""
        return cls(quotas, caller, key.limits, key.max_adapters, key.max_adapter_bytes)

    async def admit(self, cost: int, request_id: str, num_sequences: int = 1, sequences_param: str = "n") -> Ticket:
        return await self.quotas.admit(self.caller.tenant_id, self.limits, cost, request_id,
                                               num_sequences, sequences_param)


def get_quota(quotas: QuotasDep, caller: CurrentCaller, key: ApiKeyDep) -> QuotaGate:
    return QuotaGate.of(quotas, caller, key)


TenantQuota = Annotated[QuotaGate, Depends(get_quota)]


@dataclass(frozen=True)
class ModelCall:
    """A completion's caller, quota and what its `model` names (None: neither the base model nor one of
    the caller's adapters; the route answers 404 once the body is known to be valid)."""

    gate: QuotaGate
    target: Target | None


async def get_model_call(request: Request, sessions: SessionsDep, quotas: QuotasDep, adapters: TenantAdaptersDep,
                         credentials: TokenDep) -> ModelCall:
    """Key, tenant, quota and the adapter `model` names, in one database session.

    `model` is read from the JSON FastAPI has already parsed (and keeps on the request) rather than the
    route's body model: a dependency that declared the body would turn a bad key with a bad body into a
    400 instead of the 401 OpenAI answers first. The body is validated after this, as before."""
    try:
        data = await request.json()  # parsed once: Starlette keeps it on the request
    except ValueError:  # not JSON: the body's validation answers 400 after this
        data = None
    model = data.get("model") if isinstance(data, dict) else None

    def read() -> ModelCall:
        with sessions() as session:
            key = authenticate(session, credentials)
            caller = caller_of(key)  # 403 for an admin key, before any adapter is looked up
            target = adapters.find(session, key.tenant_id, model) if isinstance(model, str) else None
        return ModelCall(QuotaGate.of(quotas, caller, key), target)

    return await asyncio.to_thread(read)


ModelCallDep = Annotated[ModelCall, Depends(get_model_call)]


def get_admin(key: ApiKeyDep) -> Identity:
    if key.role != "admin":
        raise permission_denied("The admin API takes an admin key.")
    return key


AdminKey = Annotated[Identity, Depends(get_admin)]


async def metrics_access(settings: SettingsDep, sessions: SessionsDep, credentials: TokenDep) -> None:
    """With `LORAPLEX_METRICS_AUTH=true`, GET /metrics takes an admin key (401, or 403 for a tenant's key),
    as LiteLLM's `require_auth_for_metrics_endpoint` does: its series name tenants. Open otherwise, as
    vLLM's and most Prometheus exporters are (Prometheus sends the key with `authorization: {credentials}`)."""
    if settings.metrics_auth:
        key = await asyncio.to_thread(get_identity, sessions, credentials)
        if key.role != "admin":
            raise permission_denied("GET /metrics takes an admin key on this server (LORAPLEX_METRICS_AUTH).")
