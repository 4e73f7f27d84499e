"""`AsyncLLM`: the engine behind an asyncio server.

The step loop runs in its own thread, so a forward pass never blocks the event loop. Requests and
aborts reach it through a command queue (the engine is single-threaded), one command per call (a call
being all the requests of one API request, its adapter registered in the same command). Each step's
deltas come back in one hand-off per event loop: one `call_soon_threadsafe` that gives every call its
outputs of the step (`submit_to`'s sink; `submit` wraps a sink around an asyncio queue). Leaving the
`async for` of `generate` early (a client that disconnects) aborts the request and frees its KV blocks.
A step that raises (no request to blame) aborts the running batch with `RequestOutput.error` set, and
the loop keeps serving the waiting requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Same arguments as `loraplex.LLM`. `submit` queues one call's requests (a server's path; the waiting
    queue sheds what it has no room for), `generate` streams one request, `abort` cancels.

    start: run the step loop on a thread of its own (True), or leave it to the caller, who calls `run()`
    on the thread that should own it (`loraplex serve`: the process's main thread, the event loop on
    another). On the CPU, the thread that builds the engine should run it: PyTorch's OpenMP team belongs
    to the thread that starts it. With libgomp's spinning wait policy, a 2-thread engine stepping from a
    second Python thread ran the small workload at 0.75x of the same engine on the main thread (with
    the passive policy loraplex sets by default, both ran about as slow; docs/performance.md).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", *, start: bool = True, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._thread: threading.Thread | None = None
        self._progress_at = time.monotonic()  # when the step loop last finished a command or a step
        self._idle = False  # the step loop waits for a command with nothing to step
        if start:
            self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the step loop on the calling thread until `shutdown()` (only with start=False)."""
        if self._thread is not None:
            raise RuntimeError("this AsyncLLM's step loop already runs on a thread of its own")
        self._loop()

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str], *,
                     adapter: str | None = None, tenant_id: int | None = None,
                     tenant_weight: float = 1.0) -> asyncio.Queue:
        """Queue one call's requests, all or none, and return the asyncio queue that every delta of theirs
        arrives on (`RequestOutput.request_id` tells which; the last of each has `finish_reason` set).

        Raises, before anything is queued, ValueError if a request is refused for its input and
        EngineOverloadedError if the waiting queue has no room. The caller `abort`s the requests it stops
        reading before they finish.
        """
        deltas: asyncio.Queue = asyncio.Queue()

        def sink(outs: list[RequestOutput]) -> None:
            for out in outs:
                deltas.put_nowait(out)

        await self.submit_to(prompts, params, request_ids, sink, adapter=adapter, tenant_id=tenant_id,
                             tenant_weight=tenant_weight)
        return deltas

    async def submit_to(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str],
                        sink: Sink, *, adapter: str | None = None, adapter_path: str | None = None,
                        adapter_digest: str | None = None, tenant_id: int | None = None,
                        tenant_weight: float = 1.0) -> str | None:
        """`submit` with `sink(outputs)` called on this event loop once per step with the call's outputs of
        that step, in row order (the server's path: no queue between the engine and the response).

        adapter_path: where `adapter`'s files are, to register it (already validated: the adapter store's,
        whose content digest is adapter_digest; None: computed from the files) if the engine does not know
        it, in the same command that queues the requests, so a request waits for one step boundary of the
        engine thread, not two. The sink must not raise or block. Returns where the adapter was when the
        call arrived (`AdapterManager.tier`: "slots", "cpu", "loading", "failed", "disk"), None without one.
        """
        loop = asyncio.get_running_loop()
        grammars = await self.compile_schemas(params)
        try:
            return await self._call(self._add, prompts, params, adapter, (adapter_path, adapter_digest),
                                    request_ids, tenant_id, tenant_weight, (loop, sink), grammars)
        except asyncio.CancelledError:
            # The add may run after we stop waiting; the queue is FIFO, so this abort comes after it.
            self.abort_nowait(*request_ids)
            raise

    async def compile_schemas(self, params: list[SamplingParams], param: str = "json_schema") -> dict[int, object]:
        """Compile the distinct `json_schema`s of `params` in a worker thread, off the step loop
        (`StructuredOutputs.compile`); returns the compiled matchers by `id(schema)`, for `add_requests`.
        Raises its ParamError, naming `param`, for a schema it refuses."""
        schemas = {id(p.json_schema): p.json_schema for p in params if p.json_schema is not None}
        return {key: await asyncio.to_thread(self.engine.structured.compile, schema, param)
                for key, schema in schemas.items()}

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                       adapter: str | None = None, request_id: str | None = None,
                       tenant_id: int | None = None, tenant_weight: float = 1.0) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request; the last one has `finish_reason` set. Raises as `submit` does,
        before the first delta. Leaving the loop early aborts the request."""
        rid = request_id or f"async-{uuid.uuid4().hex}"
        deltas = await self.submit([prompt_token_ids], [sampling_params or SamplingParams()], [rid],
                                   adapter=adapter, tenant_id=tenant_id, tenant_weight=tenant_weight)
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort_nowait(rid)

    async def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are skipped); their resources are freed before this
        returns, and a stream still read gets each one's last delta."""
        await self._call(self._abort, *request_ids)

    def abort_nowait(self, *request_ids: str) -> None:
        """`abort` without waiting for it: safe from synchronous code (a `finally`, a callback)."""
        self._commands.put((self._abort, request_ids, concurrent.futures.Future()))

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine thread (e.g. `engine.adapters.register`), returning its result."""
        return await self._call(fn, *args)

    def seconds_without_progress(self) -> float:
        """Seconds since the step loop last finished a command or a step while it has work (queued commands
        or unfinished requests); 0 when it has none. A health check's reading, from any thread: a wedged
        step (a kernel that never returns) grows it while the thread stays alive."""
        if self._idle or (self._commands.empty() and not self.engine.has_unfinished_requests()):
            return 0.0
        return time.monotonic() - self._progress_at

    def is_alive(self) -> bool:
        """False once the step loop's own thread has ended (it never ends on a failed command or step, only
        at `shutdown`); True where the caller runs the loop (start=False)."""
        return self._thread is None or self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the step loop (a `run()` returns); waits up to 10 s for the loop's own thread, if any."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # engine thread ------------------------------------------------------------------------------
    async def _call(self, fn, *args):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    def _add(self, prompts, params, adapter, source, request_ids, tenant_id, tenant_weight, stream,
             grammars) -> str | None:
        adapter_path, adapter_digest = source
        tier = None if adapter is None else self.engine.adapters.tier(adapter)
        if adapter_path is not None and adapter not in self.engine.adapters:
            self.engine.adapters.register(adapter, adapter_path, validated=True, digest=adapter_digest)
        self.engine.add_requests(prompts, params, adapter, request_ids, tenant_id, tenant_weight, shed=True,
                                 grammars=grammars)
        for rid in request_ids:
            self._streams[rid] = stream
        return tier

    async def abort_all(self) -> int:
        """Abort every request of the engine, waiting ones too, in one command (shutdown); returns how
        many there were."""
        return await self._call(lambda: self._abort(*list(self.engine.requests)))

    def _abort(self, *request_ids: str) -> int:
        outs = []
        for rid in request_ids:
            try:
                out = self.engine.abort_request(rid)
            except Exception:  # abort_request ends the request even when it raises; go on with the rest
                logger.exception("abort of %s failed", rid)
                continue
            if out is not None:
                outs.append(out)
        self._deliver(*outs)
        return len(outs)

    def _run_command(self, cmd) -> None:
        fn, args, fut = cmd
        cancelled = not fut.set_running_or_notify_cancel()  # the caller stopped waiting
        try:
            result = fn(*args)
        except Exception as exc:  # handed to the awaiting caller
            if not cancelled:
                fut.set_exception(exc)
            return
        if not cancelled:
            fut.set_result(result)

    def _deliver(self, *outs: RequestOutput) -> None:
        """Hand outputs to their streams' sinks: one wake-up of each consumer's event loop for all of a
        step's outputs, not one per output (each wake-up is a syscall and a GIL hand-over that the engine
        thread waits on), and one sink call per stream with its outputs in order."""
        by_loop: dict[asyncio.AbstractEventLoop, dict[Sink, list[RequestOutput]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, sink = stream
            by_loop.setdefault(loop, {}).setdefault(sink, []).append(out)
        for loop, batches in by_loop.items():
            _feed_threadsafe(loop, batches)

    def _loop(self) -> None:
        while True:
            try:
                self._idle = not self.engine.has_unfinished_requests()
                cmd = self._commands.get(block=self._idle)
                self._idle, self._progress_at = False, time.monotonic()
                while True:
                    if cmd is None:
                        return
                    self._run_command(cmd)
                    self._progress_at = time.monotonic()
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                pass
            except Exception:  # never let a command kill the engine thread
                logger.exception("engine command failed")
            if not self.engine.has_unfinished_requests():
                continue
            try:
                self._deliver(*self.engine.step())
            except Exception as exc:  # no request to blame (the forward pass): end the batch, keep serving
                logger.exception("engine step failed; aborting the batch")
                self._abort_batch(f"the engine step failed: {type(exc).__name__}: {exc}")
            self._progress_at = time.monotonic()

    def _abort_batch(self, error: str) -> None:
        """End the running requests with `error`; the waiting ones go on, unless nothing was running (a
        step that fails with no batch would fail again on the same queue)."""
        sched = self.engine.scheduler
        victims = list(sched.running) or list(sched.waiting)
        for req in victims:
            req.error = error
        self._abort(*(r.request_id for r in victims))
        for req in victims:  # a stream whose abort raised (logged above) ends too: no reader waits forever
            stream = self._streams.pop(req.request_id, None)
            if stream is not None:
                out = RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                    token_ids=list(req.output_token_ids), text="", finish_reason="abort",
                                    adapter=req.adapter, error=error)
                _feed_threadsafe(stream[0], {stream[1]: [out]})


Sink = Callable[[list[RequestOutput]], None]


def _feed_threadsafe(loop: asyncio.AbstractEventLoop, batches: dict[Sink, list[RequestOutput]]) -> None:
    try:
        loop.call_soon_threadsafe(_feed_all, batches)
    except RuntimeError:  # the consumer's event loop is closed: nobody reads these streams
        pass


def _feed_all(batches: dict[Sink, list[RequestOutput]]) -> None:
    for sink, outs in batches.items():
        try:
            sink(outs)
        except Exception:  # one consumer's bug must not starve the others of this step's outputs
            logger.exception("a stream's sink failed")
