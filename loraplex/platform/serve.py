"""`loraplex serve`: migrations, first-start admin key, engine, then uvicorn on the gateway app."""

from __future__ import annotations

import logging


def serve(host: str | None = None, port: int | None = None, model: str | None = None,
          log_level: str = "info") -> None:
    import uvicorn

    from loraplex.platform.config import Settings
    from loraplex.platform.main import create_app

    overrides = {k: v for k, v in (("host", host), ("port", port), ("model", model)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                timeout_graceful_shutdown=30)
