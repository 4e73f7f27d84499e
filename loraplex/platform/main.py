"""`create_app`: assembles the FastAPI app (routers, error handlers, lifespan). Nothing else lives here."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from loraplex.platform import dashboard
from loraplex.platform.api.routes import adapters, admin, chat, completions, health, models
from loraplex.platform.config import Settings
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.errors import install_error_handlers
from loraplex.platform.gateway import open_gateway
from loraplex.platform.middleware import BodyLimitMiddleware, ShedMiddleware


def create_app(settings: Settings | None = None, engine: EngineClient | None = None, *,
               migrate: bool = True) -> FastAPI:
    """The gateway app. `engine`: an already loaded engine to share (tests, or the engine replicas of a
    scale-out); the app then leaves it running. migrate=False: the schema and the store's files are
    already up to date (a scale-out's driver migrated once, before starting the ingresses)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.gateway = open_gateway(settings, engine, migrate=migrate)
        try:
            yield
        finally:
            await app.state.gateway.close()

    app = FastAPI(title="loraplex", summary="Multi-tenant LoRA serving with an OpenAI-compatible API",
                  lifespan=lifespan, strict_content_type=False)
    # JSON bodies past LORAPLEX_MAX_REQUEST_BYTES are refused as they arrive; uploads have their own limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes, exempt=("/v1/adapters",))
    app.add_middleware(ShedMiddleware)  # added last: the outermost, so a shed request costs the least
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1")
    for module in (models, chat, completions, adapters):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(admin.router)
    app.include_router(dashboard.router)
    app.include_router(health.router)
    return app
