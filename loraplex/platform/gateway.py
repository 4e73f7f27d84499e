"""The gateway's long-lived parts, built once per app in its lifespan: database, engine, quota counters,
usage writer, metrics, adapter store, and the services the routes call (completions, tenant adapters,
the lifecycle of detached work). Routes reach them through `api/deps.py`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapters.store import AdapterStore
from loraplex.platform import crud, db
from loraplex.platform.completion import Completions
from loraplex.platform.config import QuotaDefaults, Settings
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.lifecycle import Lifecycle
from loraplex.platform.metrics import Metrics
from loraplex.platform.quotas.memory import MemoryBackend
from loraplex.platform.quotas.service import QuotaService
from loraplex.platform.store_migrations import adopt_legacy_files
from loraplex.platform.tenant_adapters import TenantAdapters
from loraplex.platform.usage import UsageWriter, tokens_since


@dataclass
class Gateway:
    """What one gateway process runs on. Routes take its parts through `api/deps.py`, not the whole."""

    settings: Settings
    quota_defaults: QuotaDefaults
    db: Engine
    sessions: sessionmaker[Session]
    engine: EngineClient
    quotas: QuotaService
    usage: UsageWriter
    metrics: Metrics
    store: AdapterStore
    lifecycle: Lifecycle
    completions: Completions
    adapters: TenantAdapters
    owns_engine: bool = True
    started_at: int = field(default_factory=lambda: int(time.time()))

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting and wait up to `grace_s` seconds for running requests (`Lifecycle.drain`)."""
        return await self.lifecycle.drain(grace_s, self.engine.abort_all)

    async def close(self) -> None:
        await self.lifecycle.wait(30)
        await asyncio.to_thread(self.usage.close)
        await self.quotas.close()
        if self.owns_engine:
            self.engine.shutdown()
        self.db.dispose()


def load_engine(settings: Settings, *, start: bool = True) -> EngineClient:
    """The engine of `settings`; start=False leaves its step loop to the caller (`AsyncLLM.run`)."""
    from loraplex.engine.async_llm import AsyncLLM

    return EngineClient(AsyncLLM(settings.model, start=start, **settings.engine_kwargs()), settings.model_id)


def prepare_storage(settings: Settings, sessions: sessionmaker[Session] | None = None) -> None:
    """Bring the database and adapter store up to date, once per deployment before its gateways serve:
    apply migrations (Alembic), make sure an admin key exists (printing a new one once), move in the
    adapter files of older gateways. `sessions`: the database's (default: a connection opened here)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    url = settings.sqlalchemy_url
    db.upgrade(url)  # the schema; the store's files below, once the store is open
    own = db.make_engine(url, 1) if sessions is None else None
    try:
        sessions = sessions or db.make_session_factory(own)
        with sessions() as s:
            admin = settings.admin_key.get_secret_value() if settings.admin_key else None
            new_key = crud.ensure_admin_key(s, admin)
        if new_key is not None:
            print(f"\nloraplex: created the admin key (shown once, store it now):\n\n    {new_key}\n", flush=True)
        adopt_legacy_files(AdapterStore(settings.adapters_dir), sessions)
    finally:
        if own is not None:
            own.dispose()


def open_gateway(settings: Settings, engine: EngineClient | None = None, *, migrate: bool = True) -> Gateway:
    """`prepare_storage` (unless migrate=False: done already), open the database and adapter store, start
    the engine (unless one is passed in, which the caller
    keeps owning) and the usage writer."""
    settings.home.mkdir(parents=True, exist_ok=True)
    db_engine = db.make_engine(settings.sqlalchemy_url, settings.db_pool_size)
    sessions = db.make_session_factory(db_engine)
    if migrate:
        prepare_storage(settings, sessions)
    store = AdapterStore(settings.adapters_dir)
    if settings.redis_url:
        from loraplex.platform.quotas.redis_backend import RedisBackend

        backend = RedisBackend(settings.redis_url, settings.redis_timeout_s)
    else:
        backend = MemoryBackend()
    quotas = QuotaService(backend, fail_mode=settings.quota_fail_mode, lease_s=settings.concurrency_lease_s,
                          budget_seed=lambda tenant_id, start: tokens_since(sessions, tenant_id, start))
    owns_engine = engine is None
    if engine is None:
        engine = load_engine(settings)
    metrics, usage = Metrics(), UsageWriter(sessions)
    lifecycle = Lifecycle(metrics)
    return Gateway(settings=settings, quota_defaults=QuotaDefaults(), db=db_engine, sessions=sessions,
                   engine=engine, quotas=quotas, usage=usage, metrics=metrics, store=store, lifecycle=lifecycle,
                   completions=Completions(engine, settings, quotas, usage, metrics, lifecycle),
                   adapters=TenantAdapters(sessions, store, engine, lifecycle, settings.max_upload_bytes),
                   owns_engine=owns_engine)
