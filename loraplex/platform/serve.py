"""`loraplex serve`: migrations, first-start admin key, engine, then uvicorn on the gateway app.

SIGTERM drains before it stops (what Kubernetes sends, then waits `terminationGracePeriodSeconds`, 30 s
by default): new requests get 503 `server_shutting_down` with retry-after and /health answers 503,
running requests get `LORAPLEX_SHUTDOWN_GRACE_S` (25 s, leaving time to write usage before a SIGKILL at
30 s) to finish, their usage is written, then the process exits 0. A second SIGTERM or a Ctrl+C during
the drain stops at once (usage not yet written is lost); a Ctrl+C otherwise shuts down as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

logger = logging.getLogger(__name__)

# Longer than clients keep an idle pooled connection (httpx: 5 s, uvicorn's own default too) and than
# load balancers' idle timeouts (60 s): the server never closes a connection just as a client reuses it,
# which a client sees as a failed request (ReadError) under load.
KEEP_ALIVE_S = 65


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM drains the gateway (`Gateway.drain`) before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float):
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_draining = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._is_draining:  # a second signal: stop now
            self.force_exit = True
        if sig != signal.SIGTERM or self._is_draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._is_draining = True
        logger.info("SIGTERM: draining (grace %.0f s)", self.grace_s)
        # Not recorded as a captured signal: uvicorn would re-raise it after shutdown, and the process
        # would end by the signal instead of exiting 0 once drained.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.app.state.gateway.drain(self.grace_s)
        finally:
            self.should_exit = True


def serve(host: str | None = None, port: int | None = None, model: str | None = None,
          log_level: str = "info") -> None:
    from loraplex.platform.config import Settings
    from loraplex.platform.main import create_app

    overrides = {k: v for k, v in (("host", host), ("port", port), ("model", model)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=30, timeout_keep_alive=KEEP_ALIVE_S)
    DrainingServer(config, app, settings.shutdown_grace_s).run()
