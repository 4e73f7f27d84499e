"""GET /health (readiness: 503 while shutting down or while no engine can run a call, so a load balancer
stops sending) and GET /metrics (Prometheus; with LORAPLEX_METRICS_AUTH, an admin key)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from loraplex.platform.api.deps import EngineDep, LifecycleDep, MetricsDep, metrics_access

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok", "draining", "unavailable"]
    detail: str | None = None


@router.get("/health", response_model=Health, response_model_exclude_none=True,
            responses={503: {"model": Health, "description": "draining: shutting down, send elsewhere; "
                                                             "unavailable: no engine can run a call now (detail says why)"}})
async def health(lifecycle: LifecycleDep, engine: EngineDep):
    if lifecycle.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"retry-after": "1"})
    reason = await engine.unavailable()
    if reason is not None:
        return JSONResponse({"status": "unavailable", "detail": reason}, status_code=503, headers={"retry-after": "1"})
    return Health(status="ok")


@router.get("/metrics", response_class=Response, dependencies=[Depends(metrics_access)],
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
async def metrics(engine: EngineDep, registry: MetricsDep) -> Response:
    snapshot = await engine.stats()
    return Response(registry.render(snapshot), media_type=CONTENT_TYPE_LATEST)
