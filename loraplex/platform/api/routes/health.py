"""GET /health (readiness: 503 while shutting down, so a load balancer stops sending) and GET /metrics
(Prometheus)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from loraplex.platform.api.deps import EngineDep, LifecycleDep, MetricsDep

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok", "draining"]


@router.get("/health", response_model=Health,
            responses={503: {"model": Health, "description": "draining: shutting down, send elsewhere"}})
async def health(lifecycle: LifecycleDep):
    if lifecycle.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"retry-after": "1"})
    return Health(status="ok")


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
async def metrics(engine: EngineDep, registry: MetricsDep) -> Response:
    snapshot = await engine.stats()
    return Response(registry.render(snapshot), media_type=CONTENT_TYPE_LATEST)
