"""The gateway's client of the engine (`AsyncLLM` in this process): tenant adapters in the engine,
running requests and their fan-out into choices, tokenization, engine stats.

Adapters are registered under their engine names (`adapter_names.engine_name`) on first use, in the
same engine command that queues the call (several gateway processes each load what their own requests
need). Nothing is read then: the engine thread never parses an adapter; its first load, on the load
thread, checks the store's files once more as it reads them (a file damaged since ends the requests
for it with the reason). The gateway counts its requests per
adapter: deleting an adapter waits for them to finish, then unregisters it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import NamedTuple

from loraplex.adapters.manager import AdapterInUseError
from loraplex.engine.async_llm import AsyncLLM
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineClient:
    """The engine as the gateway's routes use it: `llm` the in-process `AsyncLLM`, `model_id` the base
    model's public name. Runs on the event loop; engine state is read on the engine thread (`llm.call`)."""

    def __init__(self, llm: AsyncLLM, model_id: str):
        self.llm = llm
        self.model_id = model_id
        core = llm.engine
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.max_lora_rank = core.config.max_lora_rank
        self.max_num_seqs = core.config.max_num_seqs
        self.max_model_len = core.model_config.max_model_len
        self.kv_capacity_tokens = core.block_manager.num_blocks * core.block_manager.block_size
        self._init_counters()

    def _init_counters(self) -> None:
        self.num_running_by_adapter: Counter[str] = Counter()
        self.num_admitting = 0  # requests between the door and submit (event loop only)

    async def start(self) -> None:
        """Ready for the routes (the in-process engine is, once built; `RayEngineClient` asks a replica)."""

    async def unavailable(self) -> str | None:
        """Why no call can run now (GET /health answers 503 with it), or None: here, the step loop's thread
        has ended (it only does at shutdown)."""
        return None if self.llm.is_alive() else "the engine's step loop has stopped"

    # adapters -----------------------------------------------------------------------------------
    def hold(self, name: str) -> None:
        """Count a request on `name` from the moment it is resolved; `remove_adapter` waits for it."""
        self.num_running_by_adapter[name] += 1

    def release(self, name: str) -> None:
        self.num_running_by_adapter[name] -= 1
        if not self.num_running_by_adapter[name]:
            del self.num_running_by_adapter[name]

    async def remove_adapter(self, name: str, poll_s: float = 0.05) -> None:
        """Wait until no request uses `name` (this gateway's, then the engine's), then unload it."""
        core = self.llm.engine

        def unload() -> bool:
            try:
                core.unload_adapter(name)
            except KeyError:  # never registered in this process, or already gone
                return True
            except AdapterInUseError:
                return False
            return True

        while self.num_running_by_adapter.get(name) or not await self.llm.call(unload):
            await asyncio.sleep(poll_s)

    async def abort_all(self) -> int:
        """Abort every request of the engine (shutdown after its grace period); returns how many."""
        return await self.llm.abort_all()

    def is_queue_full(self) -> bool:
        """True when the engine's waiting queue cannot take one more request behind the ones admitted at
        the door and not yet submitted, for any tenant (`Scheduler.may_have_room`): a cheap test from
        the event loop, racy by a step at most, that lets the gateway shed before it reads a body. The
        exact test is the engine's own, at submit; this one fails open."""
        try:
            return not self.llm.engine.scheduler.may_have_room(self.num_admitting)
        except Exception:  # state changed under us: let the engine decide at submit
            return False

    def start_admitting(self, state: dict) -> None:
        """A request passed the door (`ShedMiddleware`); until `stop_admitting` it counts as waiting, so a
        burst that arrives before any of it reaches the engine is shed at the door too."""
        state["admitting"] = True
        self.num_admitting += 1

    def stop_admitting(self, state: dict) -> None:
        """The request reached the engine, was refused, or ended (idempotent)."""
        if state.pop("admitting", False):
            self.num_admitting -= 1

    # stats --------------------------------------------------------------------------------------
    async def stats(self) -> dict:
        """Running and waiting requests, KV cache and adapter residency, read on the engine thread."""
        return await self.llm.call(engine_stats, self.llm.engine)

    async def compile_schema(self, schema: dict) -> None:
        """Compile `schema` for constrained decoding in a worker thread and cache it in the engine
        (`StructuredOutputs.compile`); raises its ParamError (param "response_format") if refused."""
        await self.llm.compile_schemas([SamplingParams(json_schema=schema)], "response_format")

    # tokens -------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def shutdown(self) -> None:
        self.llm.shutdown()

    # requests -----------------------------------------------------------------------------------
    async def submit_to(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str],
                        sink, **kwargs) -> Placement:
        """Queue one call's requests, all or none (`AsyncLLM.submit_to`: same arguments and errors);
        returns where they run."""
        return Placement(None, await self.llm.submit_to(prompts, params, request_ids, sink, **kwargs))

    def abort_nowait(self, *request_ids: str) -> None:
        """Abort requests of calls queued by `submit_to` without waiting (safe in a `finally`)."""
        self.llm.abort_nowait(*request_ids)


class Placement(NamedTuple):
    """Where a call runs: `replica`, the engine replica's name (None: this process's engine), and
    `adapter_tier`, where its adapter was when the call arrived there (`AdapterManager.tier`: "slots",
    "cpu", "loading", "failed" or "disk"; None for the base model)."""

    replica: str | None
    adapter_tier: str | None


def engine_stats(core) -> dict:
    """A snapshot of an LLMEngine (call on its thread). `adapters` is `AdapterManager.adapter_stats()`:
    per tier ("slots" adapter slots, "cpu" host memory, "disk") capacity, occupancy, hits, misses, evictions, and
    each adapter's tier under its engine name `<tenant_id>:<name>:<digest>`."""
    bm = core.block_manager
    return {
        "num_running": len(core.scheduler.running),
        "num_waiting": len(core.scheduler.waiting),
        "kv_cache_usage": bm.usage,
        "num_kv_blocks": bm.num_blocks,
        "num_free_kv_blocks": bm.num_free_blocks,
        "num_steps": core.num_steps,
        "num_batched_rows": core.num_batched_rows,
        "num_generated_tokens": core.num_generated_tokens,
        "num_preemptions": core.scheduler.num_preemptions,
        "scheduling_policy": core.config.scheduling_policy,
        "prefix_cache": {"enabled": bm.enable_prefix_caching, "num_query_tokens": bm.num_cached_query_tokens,
                         "num_hit_tokens": bm.num_cached_hit_tokens, "num_cached_blocks": bm.num_cached_blocks,
                         "num_evicted_blocks": bm.num_evicted_blocks},
        "tenants": core.scheduler.tenant_stats(),
        "adapters": core.adapters.adapter_stats(),
    }


class Choice:
    """One engine request's result so far: its latest output's fields. `error`: why the engine ended it
    (finish reason "abort"). `token_ids` and `text` are read from the latest output when asked for (an
    unfinished output builds them on first read), so a step's update costs O(1)."""

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.finish_reason: str | None = None
        self.ttft_s: float | None = None
        self.latency_s: float | None = None
        self.error: str | None = None
        self.adapter_failed = False  # the error is its adapter's load or placement: nothing of it ran
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (`RequestOutput`)

    @property
    def token_ids(self) -> list[int]:
        return [] if self.output is None else self.output.token_ids

    @property
    def text(self) -> str:
        return "" if self.output is None else self.output.text

    @property
    def logprobs(self) -> list:
        """Each output token's `TokenLogprobs` (empty unless the request asked for them)."""
        return (self.output.logprobs if self.output is not None else None) or []

    @property
    def prompt_logprobs(self) -> list:
        """Each prompt token's entry (`RequestOutput.prompt_logprobs`; empty unless asked)."""
        return (self.output.prompt_logprobs if self.output is not None else None) or []


class Generation:
    """Engine requests for one API call (one per choice), queued all at once by `start`.

    The engine thread hands each step's outputs straight to `_feed` on the event loop (one hand-off, no
    reader task or queue in between), which updates the choices and wakes whoever streams them. Nothing
    here runs in the HTTP handler's cancel scope, so `cancel()` (plain, synchronous, safe in a `finally`
    of a cancelled stream) aborts the requests still running and their KV blocks are freed.
    `batches()` yields the (choice index, delta) pairs that arrived since it last woke, `wait()` waits
    until every request has ended.
    """

    def __init__(self, service: EngineClient, request_ids: list[str], stream: bool = True):
        self.service = service
        self.stream = stream  # keep each delta for `batches()`; a JSON answer needs only the choices
        self.request_ids = request_ids
        self.choices = [Choice() for _ in request_ids]
        self.is_cancelled = False  # by the gateway: the client went away
        self.replica: str | None = None  # the engine replica that runs the call (None: in this process)
        self.adapter_tier: str | None = None  # where its adapter was when it arrived (`Placement`)
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._num_open = len(request_ids)
        self._pending: list[tuple[int, RequestOutput]] = []
        self._wake: asyncio.Future | None = None
        self._done = asyncio.get_running_loop().create_future()

    @classmethod
    async def start(cls, service: EngineClient, prompts: list[list[int]], params: list[SamplingParams],
                    adapter: str | None, request_id: str, tenant_id: int, adapter_path: str | None = None,
                    adapter_digest: str | None = None, stream: bool = True, tenant_weight: float = 1.0) -> Generation:
        """Queue the call's requests, all or none, registering `adapter` from `adapter_path` (the store's
        validated files, whose content digest is `adapter_digest`) in the same engine command if the engine
        does not know it yet. Raises ValueError (input the engine refuses) or EngineOverloadedError (its
        waiting queue is full) with nothing queued.
        stream=False: the deltas are not kept (each carries the output so far, so keeping all of them
        would hold memory quadratic in the output's length); only `choices` and `wait()` are used."""
        gen = cls(service, [f"{request_id}-{i}" for i in range(len(params))], stream)
        gen.replica, gen.adapter_tier = await service.submit_to(prompts, params, gen.request_ids, gen._feed, adapter=adapter,
                                              adapter_path=adapter_path, adapter_digest=adapter_digest,
                                              tenant_id=tenant_id, tenant_weight=tenant_weight)
        return gen

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def num_cached_tokens(self, n: int) -> int:
        """Prompt tokens the prefix cache served, each distinct prompt counted once as in `prompt_tokens`:
        for choices prompt-major, `n` per prompt, the fewest of any of its choices."""
        return sum(min(c.num_cached_tokens for c in self.choices[i:i + n]) for i in range(0, len(self.choices), n))

    @property
    def is_done(self) -> bool:
        return self._done.done()

    def _feed(self, outs: list[RequestOutput]) -> None:
        """One step's outputs of this call (on the event loop, from the engine thread's hand-off)."""
        for out in outs:
            i = self._index[out.request_id]
            self._update(self.choices[i], out)
            self._num_open -= out.finished
            if self.stream:
                self._pending.append((i, out))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        if not self._num_open and not self._done.done():
            self._done.set_result(None)

    @staticmethod
    def _update(choice: Choice, out: RequestOutput) -> None:
        choice.output = out
        choice.finish_reason = out.finish_reason
        choice.ttft_s = out.ttft_s if out.ttft_s is not None else choice.ttft_s
        choice.latency_s = out.latency_s
        choice.error = out.error
        choice.adapter_failed = out.adapter_failed
        choice.num_cached_tokens = out.num_cached_tokens

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Everything that arrived since the last wake-up, (choice index, delta) in order, until every
        request has ended; one consumer at a time, and only for a Generation started with stream=True."""
        if not self.stream:
            raise RuntimeError("this Generation keeps no deltas (started with stream=False)")
        while self._pending or not self._done.done():  # done: every final output is already pending
            if not self._pending:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
            batch, self._pending = self._pending, []
            yield batch

    def cancel(self) -> None:
        """Abort every engine request still running (no-op once they have all ended)."""
        if self._done.done():
            return
        self.is_cancelled = True
        running = [rid for rid, c in zip(self.request_ids, self.choices, strict=True) if c.finish_reason is None]
        self.service.abort_nowait(*running)

    async def wait(self) -> None:
        """Until every engine request has ended (finished or aborted, its KV blocks freed)."""
        await asyncio.shield(self._done)
