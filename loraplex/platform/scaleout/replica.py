"""`EngineReplica`: one engine (`AsyncLLM`) as a Ray Serve replica, and the wire format of its stream.

A call arrives as one streaming request (`generate`) whose Serve multiplexed model id is the call's
engine adapter name ("" for the base model, and for a retry that the ingress routes by load alone; the
call names its adapter too). The replica marks the adapter used through
`serve.multiplexed`, which is how Ray Serve learns which replica holds which adapter (each replica
reports its ids to the routers; `router.AdapterAffinityRouter` reads them). The adapter itself is
loaded by the engine from the shared adapter store path in the call, on its load thread, exactly as in
one process (`AsyncLLM.submit_to`).

The stream: an item saying the replica has the call, one status item, then the call's outputs step by
step, as plain tuples (`WireOutput`) that carry deltas only, so a step costs O(1) per request on the wire
as in the engine:

    ("received",)  first, before anything is queued: the ingress's accept timeout ends here, so a call
        that waits for a schema to compile or for the engine's step boundary is never sent to a second
        replica (where, on the same engine, its request ids could still be in use)
    ("accepted", replica_name, adapter_tier)  queued; adapter_tier: `AdapterManager.tier` on arrival
    | ("overloaded", message, retry_after_s) | ("invalid", message, param)  refused, nothing queued
    [WireOutput, ...]  one list per engine step, until every request of the call has finished
    []  a heartbeat: nothing for a quarter of `replica_stall_timeout_s` (the call waits in the queue, or a
        long step runs), sent so that the ingress can tell this replica from a hung one

A cancelled stream (the ingress's client went away, or it aborted the call) aborts the call's engine
requests, whose KV blocks are freed at the next step boundary. An ingress that dies cancels nothing (Ray
does not cancel an actor's running calls when their caller dies), so each call names its ingress (the
`caller` actor handle) and the replica asks Ray, as often as it would send a heartbeat, whether each
ingress it runs calls for is still there; the calls of one that is dead (ActorDiedError; not one that is
only unreachable for now, or slow to answer) are aborted, as a disconnected client's are.

Serve's health check (`check_health`) fails once the engine's step loop has stopped, or has made no
progress for `replica_stall_timeout_s` while it had work (a wedged kernel): the heartbeats come from the
event loop, which a wedged engine thread does not stop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from typing import NamedTuple

import ray
from ray import serve
from ray.exceptions import ActorDiedError

from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import ParamError, SamplingParams
from loraplex.platform.config import Settings
from loraplex.platform.engine_client import engine_stats

logger = logging.getLogger(__name__)

if sys.version_info >= (3, 11):
    async def within(awaitable, timeout_s: float):
        """`await awaitable`, or TimeoutError after timeout_s (`asyncio.timeout`: no task per call, unlike
        wait_for, which costs about 12 us each on Python 3.11; these run per step per call)."""
        async with asyncio.timeout(timeout_s):
            return await awaitable
else:
    async def within(awaitable, timeout_s: float):
        """`await awaitable`, or TimeoutError after timeout_s."""
        return await asyncio.wait_for(awaitable, timeout_s)


class WireOutput(NamedTuple):
    """One `RequestOutput` as it crosses from replica to ingress: its deltas and counters; token_ids and
    text only on the last output of a request (finish_reason set), None before; prompt_logprobs (asked
    for by `SamplingParams.prompt_logprobs`) only on its first output, None on the others."""

    request_id: str
    delta_token_ids: list[int]
    delta_text: str
    delta_logprobs: list | None
    finish_reason: str | None
    ttft_s: float | None
    latency_s: float | None
    error: str | None
    adapter_failed: bool
    num_cached_tokens: int
    token_ids: list[int] | None
    text: str | None
    prompt_logprobs: list | None = None

    @classmethod
    def of(cls, out: RequestOutput, first: bool = False) -> WireOutput:
        """`out` on the wire; first: it is its request's first output (which carries its prompt_logprobs)."""
        last = out.finished
        return cls(out.request_id, out.delta_token_ids, out.delta_text, out.delta_logprobs, out.finish_reason,
                   out.ttft_s, out.latency_s, out.error, out.adapter_failed, out.num_cached_tokens,
                   out.token_ids if last else None, out.text if last else None,
                   out.prompt_logprobs if first else None)


def engine_replica(max_resident_adapters: int):
    """The engine deployment's class. `max_resident_adapters`: how many adapters each replica reports as
    resident to the routers (`serve.multiplexed`'s LRU of the ids it served last); the engine keeps its
    own slots and host cache apart from it."""

    class EngineReplica:
        """One replica: an `AsyncLLM` on `settings` (the driver's `Settings` as a dict). With no
        `num_threads` set, the engine takes as many threads as the CPUs Ray gave the replica actor."""

        def __init__(self, settings: dict):
            s = Settings(**settings)
            kwargs = s.engine_kwargs()
            if s.num_threads is None:
                cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
                if cpus:
                    kwargs["num_threads"] = max(1, int(cpus))
            from loraplex.engine.async_llm import AsyncLLM

            self.llm = AsyncLLM(s.model, **kwargs)
            self.name = serve.get_replica_context().replica_id.unique_id
            self.stall_s = s.replica_stall_timeout_s
            self.heartbeat_s = self.stall_s / 4  # also how often each caller is checked
            # ingress actor id -> its calls running here (a number per call -> the call's unfinished ids)
            self._callers: dict[object, dict[int, set[str]]] = {}
            self._watchers: set[asyncio.Task] = set()
            self._call_numbers = itertools.count()

        def check_health(self) -> None:
            """Serve's periodic health check: raises, so that Serve replaces this replica, once the engine's
            step loop has stopped or has had work and made no progress for replica_stall_timeout_s."""
            if not self.llm.is_alive():
                raise RuntimeError("the engine's step loop has stopped")
            stuck_s = self.llm.seconds_without_progress()
            if stuck_s > self.stall_s:
                raise RuntimeError(f"the engine's step loop has made no progress for {stuck_s:.0f} s")

        def info(self) -> dict:
            """What an ingress needs of the model to check calls before it routes them (`RayEngineClient`)."""
            core = self.llm.engine
            return {"tokenizer": core.tokenizer, "model_config": core.model_config,
                    "max_lora_rank": core.config.max_lora_rank, "max_num_seqs": core.config.max_num_seqs,
                    "kv_capacity_tokens": core.block_manager.num_blocks * core.block_manager.block_size}

        async def stats(self) -> dict:
            """`engine_stats` of this replica, with its name under "replica"."""
            return {**await self.llm.call(engine_stats, self.llm.engine), "replica": self.name}

        async def compile_schema(self, schema: dict) -> tuple[str, str] | None:
            """Compile a `response_format` schema (cached here); (message, param) if it is refused."""
            try:
                await self.llm.compile_schemas([SamplingParams(json_schema=schema)], "response_format")
            except ParamError as e:
                return str(e), e.param
            return None

        @serve.multiplexed(max_num_models_per_replica=max_resident_adapters)
        async def _resident(self, adapter: str) -> str:
            return adapter  # the engine loads it; this only tells Serve the replica now holds it

        async def generate(self, call: dict):
            """Run one call (`AsyncLLM.submit_to`'s arguments as a dict) and stream it as the module says."""
            # the call's adapter: its multiplexed id, except on a retry routed by load alone (no id)
            adapter = call.get("adapter") or serve.get_multiplexed_model_id() or None
            if adapter is not None:
                await self._resident(adapter)
            pending: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
            request_ids = call["request_ids"]
            yield ("received",)
            try:
                tier = await self.llm.submit_to(call["prompts"], call["params"], request_ids, pending.put_nowait,
                                         adapter=adapter, adapter_path=call["adapter_path"],
                                         adapter_digest=call["adapter_digest"], tenant_id=call["tenant_id"],
                                         tenant_weight=call["tenant_weight"])
            except EngineOverloadedError as e:
                yield ("overloaded", str(e), e.retry_after_s)
                return
            except ValueError as e:
                yield ("invalid", str(e), getattr(e, "param", None))
                return
            running = set(request_ids)
            unsent = set(request_ids)  # requests whose first output has not gone out yet
            number = next(self._call_numbers)
            calls = self._watch(call.get("caller"))
            if calls is not None:
                calls[number] = running
            try:
                yield ("accepted", self.name, tier)  # inside: a call cancelled here is aborted too
                while running:
                    try:
                        outs = list(await within(pending.get(), self.heartbeat_s))
                    except asyncio.TimeoutError:
                        yield []
                        continue
                    while not pending.empty():  # steps that arrived while the last item was sent
                        outs.extend(pending.get_nowait())
                    running.difference_update(o.request_id for o in outs if o.finished)
                    wire = []
                    for o in outs:
                        wire.append(WireOutput.of(o, o.request_id in unsent))
                        unsent.discard(o.request_id)
                    yield wire
            finally:
                if calls is not None:
                    calls.pop(number, None)
                if running:  # cancelled by the ingress
                    self.llm.abort_nowait(*running)

        def _watch(self, caller) -> dict[int, set[str]] | None:
            """The running calls of ingress `caller` (an actor handle; None: a caller Ray cannot name, left
            unwatched), with a watcher task for it started on its first call."""
            if caller is None:
                return None
            key = caller._actor_id
            calls = self._callers.get(key)
            if calls is None:
                calls = self._callers[key] = {}
                task = asyncio.get_running_loop().create_task(self._check_caller(caller, key, calls))
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
            return calls

        async def _check_caller(self, caller, key, calls: dict[int, set[str]]) -> None:
            """While `caller` has calls here, ask Ray every heartbeat_s whether it is alive; once it is dead,
            abort its calls (nobody reads them: their clients got the proxy's error). An ingress that is only
            unreachable (ActorUnavailableError: restarting, a network fault) or slow to answer is asked again."""
            try:
                while True:
                    await asyncio.sleep(self.heartbeat_s)
                    if not calls:
                        return
                    try:
                        await within(caller.__ray_ready__.remote(), 2 * self.heartbeat_s)
                    except ActorDiedError:
                        orphans = [rid for running in calls.values() for rid in running]
                        logger.warning("ingress %s is gone; aborting its %d request(s) here", key, len(orphans))
                        self.llm.abort_nowait(*orphans)
                        return
                    except Exception as e:  # unreachable for now, or slow: ask again later
                        logger.info("could not reach ingress %s: %r", key, e)
            finally:
                if self._callers.get(key) is calls:
                    del self._callers[key]

        def __del__(self):
            llm = getattr(self, "llm", None)
            if llm is not None:
                llm.shutdown()

    return EngineReplica
