"""/v1/adapters: upload (multipart), list, read and delete the caller's PEFT LoRA adapters.

Upload: a `name` field plus either the two files `adapter_config.json` and `adapter_model.safetensors`
(any field names; the file names count), or one `.zip` / `.tar.gz` holding them at its root.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from loraplex.platform import crud
from loraplex.platform.api.deps import (
    CurrentCaller,
    EngineDep,
    LifecycleDep,
    SessionDep,
    TenantAdaptersDep,
    TenantQuota,
)
from loraplex.platform.errors import invalid_request, not_found, too_large
from loraplex.platform.openai_responses import AdapterCard, AdapterList, Deleted
from loraplex.platform.tenant_adapters import adapter_card
from loraplex.platform.uploads import UploadTooLarge

router = APIRouter(prefix="/adapters", tags=["adapters"])
FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers on top of the files
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["name", "file"],
    "properties": {"name": {"type": "string", "description": "the adapter's model id for this tenant"},
                   "file": {"type": "array", "items": {"type": "string", "format": "binary"},
                            "description": "adapter_config.json and adapter_model.safetensors, or one "
                                           ".zip / .tar.gz holding them"}}}}}}}


def _limited(receive, max_bytes: int):
    """An ASGI receive that refuses a body longer than max_bytes, however it is sent (chunked too)."""
    seen = 0

    async def limited():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > max_bytes:
            raise UploadTooLarge(f"the upload exceeds the limit of {max_bytes - FORM_OVERHEAD} bytes")
        return message

    return limited


@router.post("", status_code=201, openapi_extra=UPLOAD_BODY)
async def upload_adapter(request: Request, adapters: TenantAdaptersDep, lifecycle: LifecycleDep,
                         gate: TenantQuota) -> AdapterCard:
    lifecycle.refuse_if_draining()
    limit = adapters.max_upload_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit + FORM_OVERHEAD:
        raise too_large(f"The upload is {length} bytes; the limit is {limit} bytes.")
    body = Request(request.scope, receive=_limited(request.receive, limit + FORM_OVERHEAD))
    try:
        form = await body.form(max_files=4, max_fields=8)
    except UploadTooLarge as e:
        raise too_large(f"The upload exceeds the limit of {limit} bytes.") from e
    try:
        files = {}
        for field, value in form.multi_items():
            if isinstance(value, UploadFile):
                filename = (value.filename or field).replace("\\", "/").rsplit("/", 1)[-1]
                if filename in files:
                    raise invalid_request(f"The file {filename!r} is uploaded twice.", param="file")
                files[filename] = value.file
        row = await adapters.add(gate.caller.tenant_id, form.get("name"), files, max_adapters=gate.max_adapters,
                                 max_adapter_bytes=gate.max_adapter_bytes)
    finally:
        await form.close()
    return adapter_card(adapters.engine.model_id, row)


@router.get("")
def list_adapters(engine: EngineDep, caller: CurrentCaller, session: SessionDep) -> AdapterList:
    rows = crud.list_adapters(session, caller.tenant_id)
    return AdapterList(data=[adapter_card(engine.model_id, r) for r in rows])


@router.get("/{name}")
def get_adapter(name: str, engine: EngineDep, caller: CurrentCaller, session: SessionDep) -> AdapterCard:
    row = crud.get_adapter(session, caller.tenant_id, name)
    if row is None:
        raise not_found(f"The adapter `{name}` does not exist.", param="name")
    return adapter_card(engine.model_id, row)


@router.delete("/{name}")
async def delete_adapter(name: str, adapters: TenantAdaptersDep, caller: CurrentCaller) -> Deleted:
    await adapters.delete(caller.tenant_id, name)
    return Deleted(id=name, object="adapter")
