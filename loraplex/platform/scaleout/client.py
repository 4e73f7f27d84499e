"""`RayEngineClient`: the gateway's `EngineClient` over a Ray Serve handle to the engine replicas.

The routes see the same surface as in one process. A call is one streaming request to a replica
(`replica.EngineReplica.generate`) with the call's engine adapter name as Serve's multiplexed model id,
so the router can send it where that adapter is resident. Its outputs are rebuilt here from the wire's
deltas (each request's token ids, text and logprobs accumulate on this side) and handed to the call's
sink on the event loop, one hand-off per replica step as in one process.

Faults, as the routes answer them:
- the replica refuses the call: EngineOverloadedError (503 `server_overloaded`) or ValueError (400);
- Serve's queue in front of the replicas is full (`BackPressureError`): EngineOverloadedError;
- the replica is gone before it receives the call, or does not receive it within `accept_timeout_s`
  (hung, or none running while Serve starts one): tried again, routed by queue length alone (without
  the adapter's affinity, which would pick the hung holder again), up to `SUBMIT_ATTEMPTS` times, then
  503 `replica_unavailable`; at once, without a try, while Serve reports no engine replica
  RUNNING (asked every `STATUS_S` in the background; /health answers 503 then too); nothing ran, so
  nothing is charged. Once a replica has the call (its "received" item), the call is not sent elsewhere:
  if the replica then dies or stays silent for `stall_timeout_s` before queueing it, 503 as well;
- the replica dies while it runs the call, or its stream stays silent for `stall_timeout_s` (a replica
  sends a heartbeat at least every quarter of it, so silence means hung), or ends before the call's
  requests did: each unfinished request ends with finish reason "abort" and an error starting with
  `REPLICA_LOST` (503 `replica_unavailable` with retry-after, or an SSE error event once streaming), and
  its usage is recorded as every other ended request's is.
Cancelling (the client disconnected, `abort_nowait`) cancels the Serve request; the replica aborts the
engine requests and frees their KV blocks. Each call names this ingress's actor, so that the replicas
abort its calls should it die (`replica.EngineReplica`). `stats()` answers 503 `replica_unavailable` when
its replica is lost or silent for `accept_timeout_s`, `compile_schema()` for `stall_timeout_s`.

What stays per replica: deleting an adapter waits for this ingress's calls on it, and the replicas
forget it by LRU (no request reaches it again: the gateway answers 404 first). `stats()` is the
snapshot of one replica (the router's choice), named under "replica".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import ParamError, SamplingParams
from loraplex.platform.engine_client import EngineClient, Placement
from loraplex.platform.errors import REPLICA_LOST, replica_lost
from loraplex.platform.scaleout.replica import WireOutput, within

logger = logging.getLogger(__name__)

SUBMIT_ATTEMPTS = 3  # replicas tried for a call before 503 replica_unavailable (nothing ran on any)
STATUS_S = 2.0  # how often an ingress asks Serve's controller how many engine replicas run
_LOST = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)


class _Accumulated:
    """One request's output so far, rebuilt from its `WireOutput` deltas."""

    __slots__ = ("prompt_token_ids", "token_ids", "text", "logprobs", "prompt_logprobs")

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list | None = None
        self.prompt_logprobs: list | None = None

    def output(self, w: WireOutput, adapter: str | None) -> RequestOutput:
        self.token_ids.extend(w.delta_token_ids)
        self.text.append(w.delta_text)
        if w.delta_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(w.delta_logprobs)
        if w.prompt_logprobs is not None:
            self.prompt_logprobs = w.prompt_logprobs
        done = w.finish_reason is not None
        token_ids = w.token_ids if done and w.token_ids is not None else (lambda ids=self.token_ids: list(ids))
        text = w.text if done and w.text is not None else (lambda parts=self.text: "".join(parts))
        # built when read, as token_ids: a copy per delta made the logprobs of n tokens cost O(n^2)
        logprobs = None if self.logprobs is None else list(self.logprobs) if done else (lambda lps=self.logprobs: list(lps))
        return RequestOutput(w.request_id, self.prompt_token_ids, token_ids, text, w.finish_reason, adapter,
                             ttft_s=w.ttft_s, latency_s=w.latency_s, delta_text=w.delta_text,
                             delta_token_ids=w.delta_token_ids, error=w.error, adapter_failed=w.adapter_failed,
                             num_cached_tokens=w.num_cached_tokens, logprobs=logprobs,
                             delta_logprobs=w.delta_logprobs, prompt_logprobs=self.prompt_logprobs)

    def ended(self, request_id: str, adapter: str | None, error: str | None) -> RequestOutput:
        """The last output of a request whose stream broke (error set) or that this side aborted."""
        return RequestOutput(request_id, self.prompt_token_ids, list(self.token_ids), "".join(self.text), "abort",
                             adapter, error=error,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=self.prompt_logprobs)


class _Call:
    """One call's stream from its replica and the requests of it still running."""

    def __init__(self, stream: DeploymentResponseGenerator, prompts: list[list[int]], request_ids: list[str]):
        self.stream = stream
        self.running = {rid: _Accumulated(p) for rid, p in zip(request_ids, prompts, strict=True)}
        self.is_cancelled = False

    def cancel(self) -> None:
        if not self.is_cancelled and self.running:
            self.is_cancelled = True
            self.stream.cancel()


class RayEngineClient(EngineClient):
    """`EngineClient` whose engine is the replicas behind `handle` (a handle to the `EngineReplica`
    deployment). `start()` must run (on the event loop) before the routes use it."""

    def __init__(self, handle: DeploymentHandle, model_id: str, *, accept_timeout_s: float = 10.0,
                 stall_timeout_s: float = 30.0, count_replicas: Callable[[], int] | None = None):
        """count_replicas: how many engine replicas Serve has RUNNING (blocking; `app.num_running_replicas`),
        asked every STATUS_S from `start()` on; None: never asked (then never "unavailable")."""
        self.llm = None
        self.handle = handle
        self.model_id = model_id
        self.accept_timeout_s = accept_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._init_counters()
        self._calls: dict[str, _Call] = {}  # request id -> its call, while it runs
        self._readers: set[asyncio.Task] = set()
        self._caller = _current_actor()
        self.count_replicas = count_replicas
        self.num_running_replicas: int | None = None  # Serve's last answer (None: not known yet)
        self._status_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loraplex-serve-status")
        self._status_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Read the model's tokenizer and limits from a replica (they are the same on every one)."""
        info = await self.handle.info.remote()
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_lora_rank = info["max_lora_rank"]
        self.max_num_seqs = info["max_num_seqs"]
        self.max_model_len = self.model_config.max_model_len
        self.kv_capacity_tokens = info["kv_capacity_tokens"]
        if self.count_replicas is not None:
            self._status_task = asyncio.get_running_loop().create_task(self._watch_status())

    async def _watch_status(self) -> None:
        """Every STATUS_S, how many engine replicas Serve has RUNNING (`serve.status`, on this client's own
        thread: one question at a time, skipped while the last is unanswered). An error or a slow
        controller leaves the last answer as it was: Serve's data plane works without its controller, so
        only a positive 0 makes calls and /health answer 503."""
        loop = asyncio.get_running_loop()
        asking: concurrent.futures.Future | None = None
        while True:
            if asking is None or asking.done():
                asking = self._status_thread.submit(self.count_replicas)
            try:
                self.num_running_replicas = await within(asyncio.wrap_future(asking, loop=loop), STATUS_S)
            except asyncio.TimeoutError:
                pass
            except Exception as e:
                logger.warning("could not read the engine replicas' status from Serve: %r", e)
            await asyncio.sleep(STATUS_S)

    # requests -----------------------------------------------------------------------------------
    async def submit_to(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str],
                        sink, *, adapter: str | None = None, adapter_path: str | None = None,
                        adapter_digest: str | None = None, tenant_id: int | None = None,
                        tenant_weight: float = 1.0) -> Placement:
        """Queue one call on a replica, all or none; returns the replica's name and where the adapter was
        there. Raises as the module says."""
        payload = {"prompts": prompts, "params": params, "request_ids": request_ids, "adapter": adapter,
                   "adapter_path": adapter_path, "adapter_digest": adapter_digest, "tenant_id": tenant_id,
                   "tenant_weight": tenant_weight, "caller": self._caller}
        by_adapter = self.handle.options(stream=True, multiplexed_model_id=adapter or "")
        by_load = self.handle.options(stream=True)
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            if self.num_running_replicas == 0:  # a try would only wait for Serve to start one
                raise replica_lost()
            # A retry goes by queue length alone: the replica holding the adapter may be the hung one, which
            # the router's queue-length cache (10 s) still shows as short.
            stream = (by_adapter if attempt == 1 else by_load).generate.remote(payload)
            try:
                await within(stream.__anext__(), self.accept_timeout_s)  # ("received",)
                break
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except BackPressureError as e:
                raise EngineOverloadedError(f"every engine replica's queue is full: {e}") from None
            except asyncio.TimeoutError:
                stream.cancel()  # should the replica get it after all, it drops it
                logger.warning("no engine replica received call %s within %g s (attempt %d)", request_ids[0],
                               self.accept_timeout_s, attempt)
            except (*_LOST, StopAsyncIteration) as e:
                logger.warning("engine replica lost before it received call %s (attempt %d): %r",
                               request_ids[0], attempt, e)
        else:
            raise replica_lost()
        try:  # the replica queues it: a schema to compile, the engine's next step boundary
            first = await within(stream.__anext__(), self.stall_timeout_s)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except (asyncio.TimeoutError, *_LOST, StopAsyncIteration) as e:
            stream.cancel()
            logger.warning("engine replica lost while it queued call %s: %r", request_ids[0], e)
            raise replica_lost() from None
        status = first[0]
        if status == "overloaded":
            raise EngineOverloadedError(first[1], retry_after_s=first[2])
        if status == "invalid":
            raise ParamError(first[2], first[1]) if first[2] else ValueError(first[1])
        call = _Call(stream, prompts, request_ids)
        for rid in request_ids:
            self._calls[rid] = call
        reader = asyncio.create_task(self._read(call, sink, adapter))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return Placement(first[1], first[2])

    async def _read(self, call: _Call, sink, adapter: str | None) -> None:
        error = None
        try:
            while True:
                try:
                    wire = await within(call.stream.__anext__(), self.stall_timeout_s)
                except StopAsyncIteration:
                    break
                if not wire:  # the replica's heartbeat
                    continue
                outs = [call.running[w.request_id].output(w, adapter) for w in wire]
                for out in outs:
                    if out.finished:
                        del call.running[out.request_id]
                sink(outs)
            if call.running and not call.is_cancelled:
                logger.warning("engine replica's stream ended before %d request(s) did", len(call.running))
                error = f"{REPLICA_LOST}: its stream ended early"
        except asyncio.TimeoutError:
            logger.warning("engine replica silent for %g s while running %d request(s); ending them",
                           self.stall_timeout_s, len(call.running))
            call.stream.cancel()  # should the replica come back, it aborts them
            error = f"{REPLICA_LOST}: no output for {self.stall_timeout_s:g} s"
        except Exception as e:  # the replica died, or the stream was cancelled from this side
            if not call.is_cancelled:
                logger.warning("engine replica lost while running %d request(s): %s", len(call.running), e)
                error = f"{REPLICA_LOST}: {type(e).__name__}"
        finally:
            ended = [acc.ended(rid, adapter, error) for rid, acc in call.running.items()]
            call.running.clear()
            for rid in list(self._calls):
                if self._calls[rid] is call:
                    del self._calls[rid]
            if ended:
                sink(ended)

    def abort_nowait(self, *request_ids: str) -> None:
        """Cancel the calls of `request_ids` (a call's requests end together: the gateway aborts whole calls)."""
        for call in {id(c): c for rid in request_ids if (c := self._calls.get(rid)) is not None}.values():
            call.cancel()

    async def abort_all(self) -> int:
        calls = {id(c): c for c in self._calls.values()}.values()
        num = sum(len(c.running) for c in calls)
        for call in calls:
            call.cancel()
        return num

    # the engine's state -------------------------------------------------------------------------
    def is_queue_full(self) -> bool:
        """Always False: the replicas shed at submit (503 `server_overloaded`), Serve's queue before them."""
        return False

    async def stats(self) -> dict:
        return await self._ask(self.handle.stats.remote(), self.accept_timeout_s)

    async def compile_schema(self, schema: dict) -> None:
        refused = await self._ask(self.handle.compile_schema.remote(schema), self.stall_timeout_s)
        if refused is not None:
            raise ParamError(refused[1], refused[0])

    async def _ask(self, response, timeout_s: float):
        """The result of one replica call, or 503 `replica_unavailable` if its replica is lost or silent
        for timeout_s."""
        try:
            return await within(response, timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise replica_lost() from None
        except _LOST:
            raise replica_lost() from None

    async def unavailable(self) -> str | None:
        """"no engine replica is running" while Serve's last answer (asked every STATUS_S) was none RUNNING
        (all dead, or new ones loading), else None."""
        return "no engine replica is running" if self.num_running_replicas == 0 else None

    async def remove_adapter(self, name: str, poll_s: float = 0.05) -> None:
        while self.num_running_by_adapter.get(name):
            await asyncio.sleep(poll_s)

    def shutdown(self) -> None:
        for call in {id(c): c for c in self._calls.values()}.values():
            call.cancel()
        if self._status_task is not None:
            self._status_task.cancel()
        self._status_thread.shutdown(wait=False, cancel_futures=True)


def _current_actor():
    """This process's actor handle (an ingress replica's), which replicas watch; None outside an actor."""
    try:
        return ray.get_runtime_context().current_actor
    except Exception:  # not an actor (a driver, a test): its calls run to their end if it dies
        return None

