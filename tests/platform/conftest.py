"""Gateway fixtures: one redis-server, one loaded engine and one live app for the whole session.

Everything is real: uvicorn on a TCP port, SQLite in a temp dir, redis-server in a subprocess, the
default model. Tests isolate themselves by making their own tenants (factories.make_tenant).
"""

from __future__ import annotations

import itertools

import pytest

from tests.platform import factories
from tests.platform.servers import RedisServer, ThreadServer

KV_CACHE_MEMORY = 64 << 20


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_db(redis_server):
    """redis_db() -> the session's redis-server on a database no other app of the session uses. Each app
    (its own SQLite file) numbers its tenants from 1 and keeps its quota counters by tenant id, so two apps
    on one database would count each other's requests. Database 0 is the shared `server` app's."""
    numbers = itertools.count(1)
    return lambda: f"redis://127.0.0.1:{redis_server.port}/{next(numbers)}"


@pytest.fixture(scope="session")
def engine_service(model_path):
    from loraplex.engine.async_llm import AsyncLLM
    from loraplex.platform.engine_client import EngineClient

    # No bound on the estimated queue wait: tests that send more requests than the batch holds must not
    # depend on how fast this machine steps (the bound has its own tests: test_scheduler, test_overload).
    llm = AsyncLLM(str(model_path), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_loras=4,
                   max_num_seqs=16, max_queue_wait_s=None)
    service = EngineClient(llm, factories.BASE_MODEL)
    yield service
    service.shutdown()


@pytest.fixture(scope="session")
def make_settings(tmp_path_factory):
    """make_settings(**overrides) -> Settings with a fresh home (SQLite, adapter files) and an admin key."""
    from loraplex.platform.config import Settings
    from loraplex.platform.security import new_key

    def make(**overrides) -> Settings:
        values = dict(home=tmp_path_factory.mktemp("home"), model=factories.BASE_MODEL, admin_key=new_key(),
                      redis_url=None, database_url=None, max_upload_bytes=32 << 20)  # the trained adapters: 20 MB
        return Settings(**{**values, **overrides})

    return make


@pytest.fixture(scope="session")
def start_app(engine_service):
    """start_app(settings) -> a running ThreadServer sharing the session's engine; stopped at the end."""
    from loraplex.platform.main import create_app

    servers = []

    def start(settings) -> ThreadServer:
        server = ThreadServer(create_app(settings, engine=engine_service)).start()
        server.settings = settings
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(make_settings, start_app, redis_server):
    """The shared app: Redis-backed quotas, fail open."""
    return start_app(make_settings(redis_url=redis_server.url))


@pytest.fixture(scope="session")
def admin(server):
    with factories.client(server.url, server.settings.admin_key.get_secret_value()) as c:
        yield c


@pytest.fixture
def make_tenant(server, admin):
    clients = []

    def make(**quota) -> factories.TenantClient:
        tenant = factories.make_tenant(admin, server.url, **quota)
        clients.append(tenant.client)
        return tenant

    yield make
    for c in clients:
        c.close()


@pytest.fixture(scope="session")
def peft_adapters(model_path, tmp_path_factory):
    """Two real PEFT adapters (different random weights) for the default model."""
    return factories.make_peft_adapters(model_path, tmp_path_factory.mktemp("peft"), seeds=[1, 2])


@pytest.fixture
def gateway(server):
    """The live app's Gateway (database sessions, engine, ...) for white-box checks."""
    return server.server.config.app.state.gateway
