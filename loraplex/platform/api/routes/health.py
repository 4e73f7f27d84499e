"""GET /health (liveness) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.platform.api.deps import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    snapshot = await gw.engine.stats()
    return Response(gw.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)
