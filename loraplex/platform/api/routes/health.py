"""GET /health (readiness: 503 while shutting down, so a load balancer stops sending) and GET /metrics
(Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.platform.api.deps import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(gw: GatewayDep):
    if gw.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"retry-after": "1"})
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    snapshot = await gw.engine.stats()
    return Response(gw.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)
