"""A tenant's adapters: add (validate with the engine's own checks, store, record), find by model id,
and delete.

Shared by `/v1/adapters`, the completion routes (what `model` names), the admin API and the dashboard. The files live in the
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
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapters.peft import CONFIG_NAME, SAFETENSORS_NAME, AdapterError, load_peft_adapter
from loraplex.adapters.store import AdapterStore, content_digest
from loraplex.platform import crud
from loraplex.platform.adapter_names import engine_name, store_name, store_owner
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.errors import conflict, insufficient_quota, invalid_request, not_found, too_large
from loraplex.platform.lifecycle import Lifecycle
from loraplex.platform.models import Adapter
from loraplex.platform.openai_responses import AdapterCard
from loraplex.platform.uploads import UploadError, UploadTooLarge, unpack_upload

logger = logging.getLogger(__name__)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def adapter_card(base_model: str, row: Adapter) -> AdapterCard:
    """The API's view of a tenant's adapter `row` on `base_model`."""
    return AdapterCard(id=row.name, name=row.name, parent=base_model, rank=row.rank,
                       target_modules=row.target_modules, num_bytes=row.num_bytes, digest=row.digest,
                       created_at=row.created_at.isoformat() + "Z",
                       last_used_at=row.last_used_at.isoformat() + "Z" if row.last_used_at else None)


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: the base model (all None) or one of the caller's adapters, by the
    tenant's name for it, its engine name (`adapter_names.engine_name`), its files (None: the store
    lacks them) and their content digest (the identity prefix caching keys its K/V by)."""

    adapter: str | None = None
    engine_adapter: str | None = None
    adapter_path: str | None = None
    adapter_digest: str | None = None


@dataclass(eq=False)
class TenantAdapters:
    """Adds, finds and deletes tenants' adapters: database rows in `sessions`, files in `store`, the engine
    told through `engine`. Uploads are limited to `max_upload_bytes` unpacked; unloads run on
    `lifecycle` so a client that leaves does not stop them."""

    sessions: sessionmaker[Session]
    store: AdapterStore
    engine: EngineClient
    lifecycle: Lifecycle
    max_upload_bytes: int

    # finding -----------------------------------------------------------------------------------------
    def path(self, row: Adapter) -> Path:
        """The PEFT directory of a row's files. KeyError if the store lacks them."""
        return self.store.path(store_owner(row.tenant_id), store_name(row.name, row.digest))

    def find(self, session: Session, tenant_id: int, model: str) -> Target | None:
        """What `model` names for the tenant, read in the caller's `session`: the base model, one of its
        adapters, or None (neither: the API answers 404 `model_not_found`)."""
        if model == self.engine.model_id:
            return Target()
        row = crud.get_adapter(session, tenant_id, model)
        if row is None:
            return None
        try:
            path = str(self.path(row))
        except KeyError:
            path = None
        return Target(row.name, engine_name(tenant_id, row.name, row.digest), path, row.digest)

    # adding ------------------------------------------------------------------------------------------
    def check_name(self, name: object) -> str:
        if not isinstance(name, str) or not name:
            raise invalid_request("Give the adapter a `name` form field.", param="name")
        if not NAME_RE.fullmatch(name) or name == self.engine.model_id:
            raise invalid_request(f"Adapter name {name!r} is invalid: use 1 to 64 letters, digits, '.', '_' or "
                                  "'-', starting with a letter or digit, and not the base model's id.",
                                  param="name")
        return name

    async def add(self, tenant_id: int, name: object, files: dict[str, BinaryIO], *, max_adapters: int | None,
                  max_adapter_bytes: int | None) -> Adapter:
        """Validate and store uploaded files (by file name) as the tenant's adapter `name`. On any failure
        nothing is stored. Raises APIError (400 invalid, 409 name taken, 413 too large, 429 over quota)."""
        name = self.check_name(name)
        await asyncio.to_thread(self._check_room, tenant_id, name, 0, None, None)
        tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=self.store.root))  # the store's disk, not a small /tmp
        try:
            try:
                rank, modules = await asyncio.to_thread(self._unpack_and_validate, tmp, files)
            except UploadError as e:
                if isinstance(e, UploadTooLarge):
                    raise too_large(str(e)) from None
                raise invalid_request(str(e), param=e.param) from None
            except AdapterError as e:
                raise invalid_request(f"Invalid adapter: {e}", param="file", code="invalid_adapter") from None
            return await asyncio.to_thread(self._store_and_record, tenant_id, name, tmp, rank, modules,
                                           max_adapters, max_adapter_bytes)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _unpack_and_validate(self, tmp: Path, files: dict[str, BinaryIO]) -> tuple[int, list[str]]:
        """Blocking: unpack into tmp and run the engine's validation; (rank, target modules)."""
        unpack_upload(files, tmp, self.max_upload_bytes)
        eng = self.engine
        adapter = load_peft_adapter(tmp, eng.model_config, max_lora_rank=eng.max_lora_rank)
        return adapter.rank, sorted({module for _, module in adapter.modules})

    def _check_room(self, tenant_id: int, name: str, num_bytes: int, max_adapters: int | None,
                    max_adapter_bytes: int | None) -> None:
        with self.sessions() as s:
            if crud.get_adapter(s, tenant_id, name) is not None:
                raise conflict(f"An adapter named `{name}` exists; delete it first.", param="name")
            n, size = crud.adapter_totals(s, tenant_id)
        if max_adapters is not None and n + 1 > max_adapters:
            raise insufficient_quota(f"Adapter limit reached: {n} of {max_adapters} adapters; delete one first.")
        if max_adapter_bytes is not None and size + num_bytes > max_adapter_bytes:
            raise insufficient_quota(f"Adapter storage limit reached: {size} + {num_bytes} bytes exceeds "
                                     f"{max_adapter_bytes} bytes.")

    def _store_and_record(self, tenant_id: int, name: str, tmp: Path, rank: int, modules: list[str],
                          max_adapters: int | None, max_adapter_bytes: int | None) -> Adapter:
        config, tensors = (tmp / CONFIG_NAME).read_bytes(), tmp / SAFETENSORS_NAME
        num_bytes = len(config) + tensors.stat().st_size
        self._check_room(tenant_id, name, num_bytes, max_adapters, max_adapter_bytes)
        digest = content_digest(config, tensors)
        # Exists: the same bytes under this name, from a deleted version still unloading or a concurrent upload.
        with contextlib.suppress(FileExistsError):
            self.store.put(store_owner(tenant_id), store_name(name, digest), config, tensors, digest=digest)
        try:
            with self.sessions.begin() as s:
                row = Adapter(tenant_id=tenant_id, name=name, digest=digest, num_bytes=num_bytes, rank=rank,
                              target_modules=modules)
                s.add(row)
        except IntegrityError:  # a concurrent upload of the same name won
            self._forget(tenant_id, name, digest)
            raise conflict(f"An adapter named `{name}` exists; delete it first.", param="name") from None
        return row

    # deleting ----------------------------------------------------------------------------------------
    async def delete(self, tenant_id: int, name: str) -> None:
        """Forget the adapter at once for new requests, let running ones finish, then unload it and drop
        its store entry (the files go when no other adapter shares them). 404 if it does not exist."""

        def delete_row() -> Adapter | None:
            with self.sessions.begin() as s:
                row = crud.get_adapter(s, tenant_id, name)
                if row is not None:
                    s.delete(row)
                return row

        row = await asyncio.to_thread(delete_row)
        if row is None:
            raise not_found(f"The adapter `{name}` does not exist.", param="name")
        await asyncio.shield(self.lifecycle.spawn(self._unload(row)))

    async def _unload(self, row: Adapter) -> None:
        await self.engine.remove_adapter(engine_name(row.tenant_id, row.name, row.digest))
        await asyncio.to_thread(self._forget, row.tenant_id, row.name, row.digest)

    def _forget(self, tenant_id: int, name: str, digest: str) -> None:
        """Drop the store entry of this version of `name`, unless the tenant has that version again."""
        with self.sessions() as s:
            row = crud.get_adapter(s, tenant_id, name)
        if row is not None and row.digest == digest:
            return
        with contextlib.suppress(KeyError):
            self.store.remove(store_owner(tenant_id), store_name(name, digest))
