"""`AsyncLLM`: the engine behind an asyncio server.

The step loop runs in its own thread, so a forward pass never blocks the event loop. Requests and
aborts reach it through a command queue (the engine is single-threaded); deltas come back through one
asyncio queue per request. Leaving the `async for` early (a client that disconnects) aborts the request
and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Same arguments as `loraplex.LLM`. Use `generate` to stream, `abort` to cancel."""

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                       adapter: str | None = None, request_id: str | None = None,
                       tenant_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request; the last one has `finish_reason` set.

        Raises ValueError (from `LLMEngine.add_request`) before the first delta if the request is refused.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        rid = request_id or f"async-{uuid.uuid4().hex}"
        try:
            await self._call(self.engine.add_request, prompt_token_ids, sampling_params, adapter, rid, tenant_id,
                             stream=(loop, deltas))
        except asyncio.CancelledError:
            # The add may run after we stop waiting; the queue is FIFO, so this abort comes after it.
            self._commands.put((self.engine.abort_request, (rid,), None, concurrent.futures.Future()))
            raise
        finished = False
        try:
            while True:
                out = await deltas.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put((self.engine.abort_request, (rid,), None, concurrent.futures.Future()))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its resources are freed before this returns."""
        await self._call(self.engine.abort_request, request_id)

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine thread (e.g. `engine.adapters.register`), returning its result."""
        return await self._call(fn, *args)

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    # engine thread ------------------------------------------------------------------------------
    async def _call(self, fn, *args, stream=None):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, stream, fut))
        return await asyncio.wrap_future(fut)

    def _run_command(self, cmd) -> None:
        fn, args, stream, fut = cmd
        cancelled = not fut.set_running_or_notify_cancel()  # the caller stopped waiting
        try:
            result = fn(*args)
        except Exception as exc:  # handed to the awaiting caller
            if not cancelled:
                fut.set_exception(exc)
            return
        if isinstance(result, RequestOutput) and stream is None:
            self._deliver(result)  # an abort: the stream (if still read) gets its last delta
        if stream is not None:
            self._streams[result.request_id] = stream
        if not cancelled:
            fut.set_result(result)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, deltas = stream
        try:
            loop.call_soon_threadsafe(deltas.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is closed: nobody reads this stream
            pass

    def _loop(self) -> None:
        while True:
            try:
                cmd = self._commands.get(block=not self.engine.has_unfinished_requests())
                while True:
                    if cmd is None:
                        return
                    self._run_command(cmd)
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                pass
            except Exception:  # never let a command kill the engine thread
                logger.exception("engine command failed")
            if not self.engine.has_unfinished_requests():
                continue
            try:
                for out in self.engine.step():
                    self._deliver(out)
            except Exception:  # a failed step must not kill the thread: end every request, keep serving
                logger.exception("engine step failed; aborting all requests")
                self._abort_all()

    def _abort_all(self) -> None:
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        for rid, (loop, deltas) in list(self._streams.items()):
            del self._streams[rid]
            out = RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], text="", finish_reason="abort",
                                adapter=None)
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, out)
            except RuntimeError:
                pass
