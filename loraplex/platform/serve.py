"""`loraplex serve`: the engine, then migrations, first-start admin key and uvicorn on the gateway app.

The engine's step loop runs on the process's main thread and uvicorn's event loop on a second one
(`loraplex-http`): on the CPU, PyTorch's OpenMP threads serve the thread that started them best (with
libgomp's spinning wait policy, the engine on a second thread ran the small workload at 0.75x; see
`AsyncLLM`). Signals reach the main
thread, which hands them to uvicorn (`DrainingServer.handle_exit`); when uvicorn has shut down (the
gateway drained and closed), the engine loop stops and the process exits.

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
import threading

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
          log_level: str = "info") -> int:
    """Run the gateway until SIGTERM (drained) or Ctrl+C; returns the exit status (uvicorn's
    STARTUP_FAILURE, 3, when it could not start, e.g. the port is taken; 1 when the HTTP thread failed)."""
    from loraplex.platform.config import Settings
    from loraplex.platform.gateway import load_engine
    from loraplex.platform.main import create_app

    overrides = {k: v for k, v in (("host", host), ("port", port), ("model", model)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    engine = load_engine(settings, start=False)
    llm = engine.llm
    app = create_app(settings, engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=30, timeout_keep_alive=KEEP_ALIVE_S)
    server = DrainingServer(config, app, settings.shutdown_grace_s)
    status = 0

    def http() -> None:
        nonlocal status
        try:
            server.run()  # uvicorn captures no signals off the main thread: they come from below
            status = 0 if server.started else 1
        except SystemExit as exc:  # uvicorn exits STARTUP_FAILURE when it cannot bind
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logger.exception("the HTTP server failed")
            status = 1
        finally:
            llm.shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    thread = threading.Thread(target=http, name="loraplex-http")
    thread.start()
    llm.run()
    thread.join()
    return status
