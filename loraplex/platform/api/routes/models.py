"""GET /v1/models: the base model and the caller's adapters (never another tenant's)."""

from __future__ import annotations

import calendar

from fastapi import APIRouter

from loraplex.platform import crud
from loraplex.platform.api.deps import CurrentCaller, GatewayDep, SessionDep
from loraplex.platform.errors import model_not_found
from loraplex.platform.models import Adapter

router = APIRouter(tags=["models"])


def base_model_card(gw) -> dict:
    return {"id": gw.engine.model_id, "object": "model", "created": gw.started_at, "owned_by": "loraplex",
            "parent": None, "root": gw.engine.model_id}


def adapter_model_card(gw, caller, row: Adapter) -> dict:
    return {"id": row.name, "object": "model", "created": calendar.timegm(row.created_at.timetuple()),
            "owned_by": caller.tenant_name, "parent": gw.engine.model_id, "root": gw.engine.model_id}


@router.get("/models")
def list_models(gw: GatewayDep, caller: CurrentCaller, session: SessionDep) -> dict:
    adapters = crud.list_adapters(session, caller.tenant_id)
    return {"object": "list",
            "data": [base_model_card(gw)] + [adapter_model_card(gw, caller, a) for a in adapters]}


@router.get("/models/{model:path}")
def retrieve_model(model: str, gw: GatewayDep, caller: CurrentCaller, session: SessionDep) -> dict:
    if model == gw.engine.model_id:
        return base_model_card(gw)
    row = crud.get_adapter(session, caller.tenant_id, model)
    if row is None:
        raise model_not_found(model)
    return adapter_model_card(gw, caller, row)
