"""The gateway's running work and its shutdown: detached tasks (they outlive the request that started
them) and the draining flag. Shared by the completion service, the tenant adapters, the shed middleware
and `/health`, so none of them needs the whole `Gateway`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from loraplex.platform.errors import shutting_down
from loraplex.platform.metrics import Metrics

logger = logging.getLogger(__name__)


class Lifecycle:
    """Detached tasks and the draining state of one gateway.

    `spawn` runs work a client that disconnects must not cancel (finalizing a completion, unloading a
    deleted adapter); `drain` (SIGTERM) stops admitting and waits for that work, as uvicorn's graceful
    shutdown waits for open connections."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.tasks: set[asyncio.Task] = set()
        self.is_draining = False  # shutting down: new work is refused with 503, running requests finish

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `coro` detached from the request (it survives a client that disconnects)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def refuse_if_draining(self) -> None:
        """Raise 503 `server_shutting_down` (with retry-after) once `drain` has begun."""
        if self.is_draining:
            self.metrics.observe_shed("shutting_down")
            raise shutting_down()

    async def drain(self, grace_s: float, abort_all: Callable[[], Awaitable[None]]) -> bool:
        """Stop admitting (routes answer 503 `server_shutting_down`, /health 503) and wait up to `grace_s`
        seconds for the running work to finish. True if it all did; otherwise `abort_all()` ends the
        engine's requests (their usage is recorded as aborted when they end)."""
        self.is_draining = True
        deadline = time.monotonic() + grace_s
        while self.tasks and time.monotonic() < deadline:
            await asyncio.wait(list(self.tasks), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        if not self.tasks:
            return True
        logger.warning("shutdown grace of %.0f s is over: aborting %d running request(s)", grace_s,
                       len(self.tasks))
        await abort_all()
        return False

    async def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` seconds for the detached tasks still running."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
