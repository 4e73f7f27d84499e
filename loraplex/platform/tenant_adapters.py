"""A tenant's adapters: add (validate with the engine's own checks, store, record) and delete.

Shared by `/v1/adapters` and the admin API (and the dashboard of issue 7). The files live in the
gateway's AdapterStore, one entry per version (the names: `adapter_names.py`). A deleted adapter keeps
its entry until its running requests end, so the name is free at once and a re-upload under it never
shares an entry with the version going away. The database row says what a tenant has; the store shares the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from sqlalchemy.exc import IntegrityError

from loraplex.adapters.peft import CONFIG_NAME, SAFETENSORS_NAME, AdapterError, load_peft_adapter
from loraplex.adapters.store import content_digest
from loraplex.platform import crud
from loraplex.platform.adapter_names import engine_name, store_name, store_owner
from loraplex.platform.errors import conflict, insufficient_quota, invalid_request, not_found, too_large
from loraplex.platform.models import Adapter
from loraplex.platform.openai_responses import AdapterCard
from loraplex.platform.uploads import UploadError, UploadTooLarge, unpack_upload

if TYPE_CHECKING:
    from loraplex.platform.gateway import Gateway

logger = logging.getLogger(__name__)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(gw: Gateway, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise invalid_request("Give the adapter a `name` form field.", param="name")
    if not NAME_RE.fullmatch(name) or name == gw.engine.model_id:
        raise invalid_request(f"Adapter name {name!r} is invalid: use 1 to 64 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit, and not the base model's id.", param="name")
    return name


def adapter_card(base_model: str, row: Adapter) -> AdapterCard:
    """The API's view of a tenant's adapter `row` on `base_model`."""
    return AdapterCard(id=row.name, name=row.name, parent=base_model, rank=row.rank,
                       target_modules=row.target_modules, num_bytes=row.num_bytes, digest=row.digest,
                       created_at=row.created_at.isoformat() + "Z",
                       last_used_at=row.last_used_at.isoformat() + "Z" if row.last_used_at else None)


def adapter_dir(gw: Gateway, row: Adapter) -> Path:
    """The PEFT directory of a row's files. KeyError if the store lacks them."""
    return gw.store.path(store_owner(row.tenant_id), store_name(row.name, row.digest))


def _unpack_and_validate(gw: Gateway, tmp: Path, files: dict[str, BinaryIO]) -> tuple[int, list[str]]:
    """Blocking: unpack into tmp and run the engine's validation; (rank, target modules)."""
    unpack_upload(files, tmp, gw.settings.max_upload_bytes)
    eng = gw.engine
    adapter = load_peft_adapter(tmp, eng.model_config, max_lora_rank=eng.max_lora_rank)
    return adapter.rank, sorted({module for _, module in adapter.modules})


def _check_room(gw: Gateway, tenant_id: int, name: str, num_bytes: int, max_adapters, max_adapter_bytes):
    with gw.sessions() as s:
        if crud.get_adapter(s, tenant_id, name) is not None:
            raise conflict(f"An adapter named `{name}` exists; delete it first.", param="name")
        n, size = crud.adapter_totals(s, tenant_id)
    if max_adapters is not None and n + 1 > max_adapters:
        raise insufficient_quota(f"Adapter limit reached: {n} of {max_adapters} adapters; delete one first.")
    if max_adapter_bytes is not None and size + num_bytes > max_adapter_bytes:
        raise insufficient_quota(f"Adapter storage limit reached: {size} + {num_bytes} bytes exceeds "
                                 f"{max_adapter_bytes} bytes.")


def _store_and_record(gw: Gateway, tenant_id: int, name: str, tmp: Path, rank: int, modules: list[str],
                      max_adapters, max_adapter_bytes) -> Adapter:
    config, tensors = (tmp / CONFIG_NAME).read_bytes(), tmp / SAFETENSORS_NAME
    num_bytes = len(config) + tensors.stat().st_size
    _check_room(gw, tenant_id, name, num_bytes, max_adapters, max_adapter_bytes)
    digest = content_digest(config, tensors)
    # Exists: the same bytes under this name, from a deleted version still unloading or a concurrent upload.
    with contextlib.suppress(FileExistsError):
        gw.store.put(store_owner(tenant_id), store_name(name, digest), config, tensors, digest=digest)
    try:
        with gw.sessions.begin() as s:
            row = Adapter(tenant_id=tenant_id, name=name, digest=digest, num_bytes=num_bytes, rank=rank,
                          target_modules=modules)
            s.add(row)
    except IntegrityError:  # a concurrent upload of the same name won
        _forget(gw, tenant_id, name, digest)
        raise conflict(f"An adapter named `{name}` exists; delete it first.", param="name") from None
    return row


async def add_adapter(gw: Gateway, tenant_id: int, name: str, files: dict[str, BinaryIO], *,
                      max_adapters: int | None, max_adapter_bytes: int | None) -> Adapter:
    """Validate and store uploaded files (by file name) as the tenant's adapter `name`. On any failure
    nothing is stored. Raises APIError (400 invalid, 409 name taken, 413 too large, 429 over quota)."""
    name = check_name(gw, name)
    await asyncio.to_thread(_check_room, gw, tenant_id, name, 0, None, None)
    tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=gw.store.root))  # the store's disk, not a small /tmp
    try:
        try:
            rank, modules = await asyncio.to_thread(_unpack_and_validate, gw, tmp, files)
        except UploadError as e:
            if isinstance(e, UploadTooLarge):
                raise too_large(str(e)) from None
            raise invalid_request(str(e), param=e.param) from None
        except AdapterError as e:
            raise invalid_request(f"Invalid adapter: {e}", param="file", code="invalid_adapter") from None
        return await asyncio.to_thread(_store_and_record, gw, tenant_id, name, tmp, rank, modules,
                                       max_adapters, max_adapter_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def delete_adapter(gw: Gateway, tenant_id: int, name: str) -> None:
    """Forget the adapter at once for new requests, let running ones finish, then unload it and drop
    its store entry (the files go when no other adapter shares them)."""

    def delete_row() -> Adapter | None:
        with gw.sessions.begin() as s:
            row = crud.get_adapter(s, tenant_id, name)
            if row is not None:
                s.delete(row)
            return row

    row = await asyncio.to_thread(delete_row)
    if row is None:
        raise not_found(f"The adapter `{name}` does not exist.", param="name")
    await asyncio.shield(gw.spawn(_unload(gw, row)))


async def _unload(gw: Gateway, row: Adapter) -> None:
    await gw.engine.remove_adapter(engine_name(row.tenant_id, row.name, row.digest))
    await asyncio.to_thread(_forget, gw, row.tenant_id, row.name, row.digest)


def _forget(gw: Gateway, tenant_id: int, name: str, digest: str) -> None:
    """Drop the store entry of this version of `name`, unless the tenant has that version again."""
    with gw.sessions() as s:
        row = crud.get_adapter(s, tenant_id, name)
    if row is not None and row.digest == digest:
        return
    with contextlib.suppress(KeyError):
        gw.store.remove(store_owner(tenant_id), store_name(name, digest))
