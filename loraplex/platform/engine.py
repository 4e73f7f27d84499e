"""The gateway's side of the engine: tenant adapters in the engine, running requests, engine stats.

Engine adapter names are unique across tenants and versions: `<tenant_id>:<name>:<digest[:16]>`, so a
re-uploaded adapter never reuses a stale registration. Adapters are registered on first use (several
gateway processes each load what their own requests need). The gateway counts its requests per
adapter: deleting an adapter waits for them to finish, then unregisters it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.adapters.manager import AdapterInUseError
from loraplex.engine.async_llm import AsyncLLM
from loraplex.engine.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


def engine_adapter_name(tenant_id: int, name: str, digest: str) -> str:
    return f"{tenant_id}:{name}:{digest[:16]}"


class EngineService:
    def __init__(self, llm: AsyncLLM, model_id: str):
        self.llm = llm
        self.model_id = model_id
        core = llm.engine
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.max_lora_rank = core.config.max_lora_rank
        self.max_model_len = core.model_config.max_model_len
        self.kv_capacity_tokens = core.block_manager.num_blocks * core.block_manager.block_size
        self.num_running_by_adapter: Counter[str] = Counter()

    # adapters -----------------------------------------------------------------------------------
    async def ensure_adapter(self, name: str, path: str) -> None:
        """Register `name` from `path` unless it is registered. AdapterError if the files are invalid."""
        adapters = self.llm.engine.adapters

        def ensure() -> None:  # on the engine thread: check and register in one step
            if name not in adapters:
                adapters.register(name, path)

        await self.llm.call(ensure)

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

    # stats --------------------------------------------------------------------------------------
    async def stats(self) -> dict:
        """Running and waiting requests, KV cache and adapter residency, read on the engine thread."""
        return await self.llm.call(engine_stats, self.llm.engine)

    # tokens -------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def shutdown(self) -> None:
        self.llm.shutdown()


def engine_stats(core) -> dict:
    """A snapshot of an LLMEngine (call on its thread). `adapters` is `AdapterManager.adapter_stats()`:
    per tier ("gpu" slots, "cpu" host memory, "disk") capacity, occupancy, hits, misses, evictions, and
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
        "adapters": core.adapters.adapter_stats(),
    }


@dataclass
class Choice:
    """One engine request's result so far."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: Exception | None = None


class Generation:
    """Engine requests for one API call (one per choice), each consumed by its own task.

    The tasks live outside the HTTP handler's cancel scope, so `cancel()` (plain, synchronous, safe
    in a `finally` of a cancelled stream) still lets each engine request be aborted and its KV blocks
    freed. `events()` yields (choice index, delta) as they come; `wait()` waits for every task to end.
    """

    def __init__(self, service: EngineService, prompts: list[list[int]], params: list[SamplingParams],
                 adapter: str | None, request_id: str, tenant_id: int):
        self.service = service
        self.adapter = adapter
        self.choices = [Choice() for _ in params]
        self.is_cancelled = False  # by the gateway: the client went away
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._consume(i, ids, p, f"{request_id}-{i}", str(tenant_id)))
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        self._done = asyncio.create_task(self._supervise())

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def _consume(self, i: int, prompt_ids: list[int], params: SamplingParams, rid: str,
                       tenant_id: str) -> None:
        choice = self.choices[i]
        llm = self.service.llm
        try:
            async for out in llm.generate(prompt_ids, params, adapter=self.adapter, request_id=rid,
                                          tenant_id=tenant_id):
                self._update(choice, out)
                self._queue.put_nowait((i, out))
        except asyncio.CancelledError:
            await llm.abort(rid)  # cancelled before the first delta: the request may already be queued
            choice.finish_reason = choice.finish_reason or "abort"
            raise
        except Exception as exc:  # a request the engine refused, or a failed engine
            choice.error = exc
            choice.finish_reason = "abort"
            self._queue.put_nowait((i, exc))

    async def _supervise(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @staticmethod
    def _update(choice: Choice, out: RequestOutput) -> None:
        choice.token_ids = out.token_ids
        choice.text = out.text
        choice.finish_reason = out.finish_reason
        choice.ttft_s = out.ttft_s if out.ttft_s is not None else choice.ttft_s
        choice.latency_s = out.latency_s

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        num_open = len(self.choices)
        while num_open:
            i, item = await self._queue.get()
            if isinstance(item, Exception) or item.finished:
                num_open -= 1
            yield i, item

    def cancel(self) -> None:
        """Abort every engine request still running (no-op once they have all ended)."""
        if not all(t.done() for t in self._tasks):
            self.is_cancelled = True
        for t in self._tasks:
            t.cancel()

    async def wait(self) -> None:
        """Until every engine request has ended (finished or aborted, its KV blocks freed)."""
        await asyncio.shield(self._done)
