"""Pure ASGI middlewares that refuse before a request costs anything: load shedding and a body limit.

`ShedMiddleware`: while the gateway shuts down or the engine's queue is full, a generation request is
answered 503 before its body is read, authenticated or tokenized (Envoy and Kong shed at the edge the
same way). Requests it lets through count as waiting until they reach the engine, so a burst on an idle
server is shed at the door beyond what the queue takes, not after each one is parsed and tokenized.
Shedding must cost far less than serving: parsing, authenticating and tokenizing each refused request
took enough of a 2-core machine to halve the engine's throughput under 4x overload (docs/reliability.md). The exact check (tokens, the whole call) stays the engine's, at submit.

`BodyLimitMiddleware`: a body declared larger than the limit (`content-length`) is answered 413 before
it is read; a chunked one is refused with 413 once it passes the limit, so a client cannot make the
gateway buffer and parse an unbounded JSON document. The refusal is in OpenAI's error shape (Starlette's
own body limit answers a declared length with plain text). Paths in `exempt` (adapter uploads) check a
limit of their own.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from loraplex.platform.errors import APIError, engine_overloaded, too_large

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class ShedMiddleware:
    """503 at once for POSTs to `paths` while `scope["app"].state.gateway` is draining or its engine's
    queue is full (`EngineClient.is_queue_full`); counted in `loraplex_requests_shed_total`."""

    def __init__(self, app, paths: tuple[str, ...] = GENERATION_PATHS):
        self.app = app
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            gw = getattr(scope["app"].state, "gateway", None)
            error = None
            try:
                if gw is not None:
                    gw.lifecycle.refuse_if_draining()
            except APIError as e:
                error = e
            if error is None and gw is not None and gw.engine.is_queue_full():
                gw.metrics.observe_shed("engine_queue_full")
                error = engine_overloaded()
            if error is not None:
                await error.response()(scope, receive, send)
                return
            if gw is not None:
                state = scope.setdefault("state", {})
                gw.engine.start_admitting(state)
                try:
                    await self.app(scope, receive, send)
                finally:
                    gw.engine.stop_admitting(state)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, exempt: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        message = f"The request body exceeds the limit of {self.max_bytes} bytes."
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await too_large(message).response()(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                # An HTTPException: FastAPI passes it on from the body read to our handler (a 413 in
                # OpenAI's shape, errors.py) instead of turning it into "error parsing the body".
                raise HTTPException(413, message)
            return msg

        await self.app(scope, limited_receive, send)
