"""GET /v1/models: the base model and the caller's adapters (never another tenant's)."""

from __future__ import annotations

import calendar

from fastapi import APIRouter

from loraplex.platform import crud
from loraplex.platform.api.deps import CurrentCaller, EngineDep, SessionDep, StartedAtDep
from loraplex.platform.errors import model_not_found
from loraplex.platform.models import Adapter
from loraplex.platform.openai_responses import ModelCard, ModelList

router = APIRouter(tags=["models"])


def base_model_card(base_model: str, started_at: int) -> ModelCard:
    return ModelCard(id=base_model, created=started_at, owned_by="loraplex", parent=None, root=base_model)


def adapter_model_card(base_model: str, caller, row: Adapter) -> ModelCard:
    return ModelCard(id=row.name, created=calendar.timegm(row.created_at.timetuple()), owned_by=caller.tenant_name,
                     parent=base_model, root=base_model)


@router.get("/models")
def list_models(engine: EngineDep, started_at: StartedAtDep, caller: CurrentCaller, session: SessionDep) -> ModelList:
    adapters = crud.list_adapters(session, caller.tenant_id)
    return ModelList(data=[base_model_card(engine.model_id, started_at)]
                     + [adapter_model_card(engine.model_id, caller, a) for a in adapters])


@router.get("/models/{model:path}")
def retrieve_model(model: str, engine: EngineDep, started_at: StartedAtDep, caller: CurrentCaller,
                   session: SessionDep) -> ModelCard:
    if model == engine.model_id:
        return base_model_card(engine.model_id, started_at)
    row = crud.get_adapter(session, caller.tenant_id, model)
    if row is None:
        raise model_not_found(model)
    return adapter_model_card(engine.model_id, caller, row)
