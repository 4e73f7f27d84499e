"""What chat and text completions share: model lookup, limits, admission, the engine run, responses.

Order for every request, each step refusing before the next costs anything: refuse while the gateway
shuts down or the engine's queue is full (503, before the body is read: `middleware.ShedMiddleware`);
resolve `model` (404 for anything not the base model or the caller's own adapter; read in the same
database session as the API key, `api/deps.get_model_call`);
bound the fan-out (`n`, prompts, sequences: 400 before tokenizing); tokenize off the event loop; check
lengths and sampling values against the model (400 naming the field); reserve quota (429); compile
`response_format`'s schema in a worker thread (400 `param: "response_format"` with the grammar
library's reason; the reservation is refunded); register the
adapter if needed; queue the call's engine requests all or none (503 `server_overloaded` when the
engine's waiting queue has no room, by count, tokens or estimated wait; the reservation is refunded).
A detached task waits for the engine requests to end, then refunds unused tokens, records usage and
metrics: it runs whether the client stayed, left, or the engine failed.
A route calls `Completions.prepare` (everything up to the quota, giving one immutable `Completion`) and
`Completions.serve` (the rest), and nothing else.
A request the engine ended for a fault of its own answers 503 `engine_error` with retry-after.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.sampling_params import ParamError, SamplingParams, check_stop_token_ids, check_top_k
from loraplex.platform.completion_response import response_body, stream
from loraplex.platform.config import Settings
from loraplex.platform.engine_client import EngineClient, Generation
from loraplex.platform.errors import (
    APIError,
    adapter_load_failed,
    engine_overloaded,
    invalid_request,
    model_not_found,
)
from loraplex.platform.lifecycle import Lifecycle
from loraplex.platform.metrics import Metrics
from loraplex.platform.openai_schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.quotas.service import QuotaService, Ticket
from loraplex.platform.tenant_adapters import Target
from loraplex.platform.usage import Usage, UsageWriter

if TYPE_CHECKING:
    from loraplex.platform.api.deps import Caller, QuotaGate


@dataclass(frozen=True)
class Completion:
    """One API call, checked and ready for the engine: built once by `prepare`, never changed after.

    prompts: the distinct prompts' token ids, each run body.n times; adapter: the tenant's name for the
    adapter (None: the base model), engine_adapter its engine name, adapter_path its files and
    adapter_digest their content digest; max_tokens
    per choice (0: `echo_only`); params one SamplingParams per sequence (prompt-major); created Unix seconds."""

    kind: str  # "chat" or "completion"
    body: ChatCompletionRequest | CompletionRequest
    prompts: tuple[list[int], ...]
    max_tokens: int
    params: tuple[SamplingParams, ...]
    request_id: str
    created: int
    adapter: str | None = None
    engine_adapter: str | None = None
    adapter_path: str | None = None
    adapter_digest: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.body.n

    @property
    def echo(self) -> bool:
        """A text completion with `echo`: each choice's text and logprobs start with its prompt's."""
        return self.kind == "completion" and bool(self.body.echo)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt is scored and nothing is generated. The engine samples
        one token all the same (vLLM does so too), which the answer leaves out and nobody is charged for."""
        return self.echo and self.max_tokens == 0

    def num_completion_tokens(self, gen: Generation) -> int:
        """Output tokens the caller gets and is charged for."""
        return 0 if self.echo_only else gen.num_completion_tokens

    @property
    def endpoint(self) -> str:
        return endpoint_of(self.kind)

    @property
    def prompt_param(self) -> str:
        return prompt_param_of(self.kind)


def endpoint_of(kind: str) -> str:
    return "chat.completions" if kind == "chat" else "completions"


def prompt_param_of(kind: str) -> str:
    return "messages" if kind == "chat" else "prompt"


@dataclass(eq=False)
class Completions:
    """Runs chat and text completions for the routes, from a parsed body to the response (vLLM's
    `OpenAIServing` role): checks against `settings` and the model of `engine`, admission through the
    caller's quota, the engine run, usage in `usage` and counts in `metrics`; finalizing runs on
    `lifecycle`, so it survives a client that disconnects and shutdown waits for it."""

    engine: EngineClient
    settings: Settings
    quotas: QuotaService
    usage: UsageWriter
    metrics: Metrics
    lifecycle: Lifecycle

    async def prepare(self, caller: Caller, target: Target | None, kind: str,
                      body: ChatCompletionRequest | CompletionRequest, num_prompts: int,
                      encode: Callable[[], list[list[int]]]) -> Completion:
        """Everything that can refuse a call before it costs quota, in order: `model` (404 when `target`,
        read with the caller's key, is None; 503 `adapter_load_failed` when its files are missing), the
        fan-out (400 before tokenizing), `encode()` (run off the event loop; it may raise APIError), lengths
        and sampling values against the model (400 naming the field)."""
        if target is None:
            raise model_not_found(body.model)
        if target.adapter is not None and target.adapter_path is None:
            raise adapter_load_failed(target.adapter, "its files are missing.")
        check_fan_out(self.settings, kind, body.n, num_prompts)
        prompts = await asyncio.to_thread(encode)
        if any(not p for p in prompts):
            raise invalid_request("The prompt is empty.", param=prompt_param_of(kind))
        max_tokens = check_lengths(self.engine, self.settings, kind, body, prompts)
        priority = call_priority(body, caller)
        params = sampling_params(self.engine.model_config.vocab_size, body, len(prompts), max_tokens, priority)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return Completion(kind, body, tuple(prompts), max_tokens, tuple(params), request_id, int(time.time()),
                          target.adapter, target.engine_adapter, target.adapter_path, target.adapter_digest)

    async def serve(self, request: Request, gate: QuotaGate, c: Completion) -> Response:
        """Admit, run and answer one prepared call (JSON or an SSE stream). Its adapter, if any, is held from
        here until `_finalize` (or an error here) releases it, so deleting it waits for this call."""
        if c.engine_adapter is not None:
            self.engine.hold(c.engine_adapter)
        running = False
        try:
            gen, ticket = await self._start(request, gate, c)
            running = True  # from here on, _finalize releases the adapter
        finally:
            if c.engine_adapter is not None and not running:
                self.engine.release(c.engine_adapter)
        finalized = self.lifecycle.spawn(self._finalize(gate.caller, c, gen, ticket))
        headers = {**ticket.headers, "x-request-id": c.request_id}
        if gen.replica is not None:  # scale-out: which engine replica served it (docs/scale-out.md)
            headers["x-loraplex-replica"] = gen.replica
        if gen.adapter_tier is not None:  # where its adapter was: "slots" is a hit, "disk" a cold load
            headers["x-loraplex-adapter-tier"] = gen.adapter_tier
        if c.body.stream:
            headers["cache-control"] = "no-cache"
            return StreamingResponse(stream(c, gen, finalized), media_type="text/event-stream", headers=headers)
        if not await wait_or_disconnect(request, gen):
            return Response(status_code=499)  # nobody is listening
        await asyncio.shield(finalized)  # the client sees its response after its quota is settled
        return JSONResponse(response_body(c, gen).model_dump(), headers=headers)

    def overloaded_answer(self, caller: Caller, c: Completion, retry_after_s: float = 1.0) -> APIError:
        """The 503 for a call the engine shed because its queue has no room, counted in /metrics."""
        self.metrics.observe_shed("engine_queue_full")
        self.metrics.observe_request(caller.tenant_name, c.endpoint, "503")
        return engine_overloaded(retry_after_s)

    async def _start(self, request: Request, gate: QuotaGate, c: Completion) -> tuple[Generation, Ticket]:
        """Reserve quota, compile the call's schema if any, then register the adapter if needed and queue
        the call's engine requests, all or none, in one engine command."""
        body, caller, engine = c.body, gate.caller, self.engine
        # Admission counts the call as the sequences it runs: each reserves its prompt and max_tokens and holds
        # a concurrency slot. The refund at the end brings the charge down to the usage reported.
        cost = body.n * c.num_prompt_tokens + c.num_sequences * c.max_tokens
        try:
            ticket = await gate.admit(cost, c.request_id, c.num_sequences, "n" if body.n > 1 else c.prompt_param)
        except APIError as e:
            self.metrics.observe_request(caller.tenant_name, c.endpoint, str(e.status_code))
            raise
        try:
            prompts = [p for p in c.prompts for _ in range(body.n)]
            try:
                if body.json_schema is not None:  # in a worker thread, once the caller is admitted; cached
                    await compile_schema(engine, body.json_schema)
                gen = await Generation.start(engine, prompts, list(c.params), c.engine_adapter, c.request_id,
                                             caller.tenant_id, adapter_path=c.adapter_path,
                                             adapter_digest=c.adapter_digest,
                                             stream=bool(c.body.stream), tenant_weight=caller.share.weight)
            finally:
                engine.stop_admitting(request.scope.setdefault("state", {}))
        except BaseException as exc:  # nothing ran: the reservation, the slots and the RPM unit go back
            self.lifecycle.spawn(self.quotas.settle(ticket, 0, ran=False))
            if isinstance(exc, EngineOverloadedError):
                raise self.overloaded_answer(caller, c, exc.retry_after_s) from None
            if isinstance(exc, ValueError):
                raise invalid_request(f"The engine refused the request: {exc}",
                                      param=getattr(exc, "param", None)) from None
            raise
        return gen, ticket

    async def _finalize(self, caller: Caller, c: Completion, gen: Generation, ticket: Ticket) -> None:
        """Once the engine requests end: release the adapter, settle the quota, record usage and metrics."""
        settled = False
        try:
            await gen.wait()
            if c.engine_adapter is not None:
                self.engine.release(c.engine_adapter)
            num_completion = c.num_completion_tokens(gen)
            ran = not all(ch.adapter_failed for ch in gen.choices)  # else its adapter never loaded: not charged
            num_prompt = c.num_prompt_tokens if ran else 0
            await self.quotas.settle(ticket, num_prompt + num_completion, ran=ran)
            settled = True
        finally:  # whatever failed or cancelled this, settle (charged in full): an unsettled call's slots are renewed
            if not settled:  # awaited: a cancelled task may still await here, and settle never raises
                await self.quotas.settle(ticket, ticket.cost)
        if any(ch.error is not None for ch in gen.choices):
            status = "error"
        elif gen.is_cancelled or any(ch.finish_reason == "abort" for ch in gen.choices):
            status = "aborted"  # by the gateway: the client left, or shutdown's grace period ran out
        else:
            status = "ok"
        ttfts = [ch.ttft_s for ch in gen.choices if ch.ttft_s is not None]
        latencies = [ch.latency_s for ch in gen.choices if ch.latency_s is not None]
        self.usage.record(Usage(request_id=c.request_id, tenant_id=caller.tenant_id, api_key_id=caller.key_id,
                                adapter=c.adapter, endpoint=c.endpoint, status=status,
                                num_prompt_tokens=num_prompt, num_completion_tokens=num_completion,
                                ttft_s=min(ttfts) if ttfts else None,
                                latency_s=max(latencies) if latencies else None))
        self.metrics.observe_request(caller.tenant_name, c.endpoint, status)
        for i, ch in enumerate(gen.choices):
            self.metrics.observe_generation(caller.tenant_name, num_prompt if i == 0 else 0,
                                            0 if c.echo_only else len(ch.token_ids), ch.ttft_s, ch.latency_s)


async def compile_schema(engine: EngineClient, schema: dict) -> None:
    """Compile `response_format`'s schema (`EngineClient.compile_schema`); 400 naming `response_format`
    with the grammar library's reason if it cannot be honoured."""
    try:
        await engine.compile_schema(schema)
    except ParamError as e:
        raise invalid_request(f"The response_format cannot be honoured: {e}", param="response_format") from None


def check_fan_out(settings: Settings, kind: str, n: int, num_prompts: int) -> None:
    """`n`, the prompt list and n x prompts against the settings, before anything is tokenized."""
    if not 1 <= n <= settings.max_n:
        raise invalid_request(f"n must be an integer in [1, {settings.max_n}], got {n}.", param="n")
    limit = settings.max_sequences_per_request
    if num_prompts > limit:
        raise invalid_request(f"The prompt list has {num_prompts} prompts; at most {limit} are allowed per "
                              "request.", param=prompt_param_of(kind))
    if n * num_prompts > limit:
        raise invalid_request(f"n x prompts is {n} x {num_prompts} = {n * num_prompts} sequences; at most {limit} "
                              "are allowed per request.", param="n")


COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's API reference; vLLM's too)


def check_lengths(eng: EngineClient, settings: Settings, kind: str, body: ChatCompletionRequest | CompletionRequest,
                  prompts: list[list[int]]) -> int:
    """Prompt tokens per call, the context and max_tokens; returns max_tokens per choice."""
    prompt_param = prompt_param_of(kind)
    total = sum(len(p) for p in prompts)
    if total > settings.max_prompt_tokens_per_request:
        raise invalid_request(f"The prompts have {total} tokens; at most {settings.max_prompt_tokens_per_request} "
                              "are allowed per request.", param=prompt_param)
    context = min(eng.max_model_len, eng.kv_capacity_tokens)
    longest = max(len(p) for p in prompts)
    if longest >= context:
        raise invalid_request(f"The prompt has {longest} tokens; this model's context is {context} tokens.",
                              param=prompt_param, code="context_length_exceeded")
    vocab = eng.model_config.vocab_size
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise invalid_request(f"Token ids must be in [0, {vocab}).", param="prompt")
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = context - longest
    cap = settings.max_tokens_limit
    if requested is not None and cap is not None and requested > cap:
        raise invalid_request(f"{param} is {requested}; at most {cap} tokens are allowed per choice.", param=param)
    if requested is not None and requested > room:
        raise invalid_request(f"{param} is {requested}, but the prompt ({longest} tokens) leaves room for "
                              f"{room} tokens in this model's context of {context} tokens.", param=param,
                              code="context_length_exceeded")
    if requested == 0 and not body.echo:  # a 0 passes the schema on completions, for echo
        raise invalid_request("max_tokens must be an integer >= 1, got 0 (0 is allowed with echo: true, to score "
                              "the prompt alone).", param="max_tokens")
    if requested is None:  # chat: the setting; completions: 16, OpenAI's and vLLM's default there
        default = settings.default_max_tokens if kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
        requested = min(default, room, cap or room)
    return requested


def call_priority(body: ChatCompletionRequest | CompletionRequest, caller: Caller) -> int:
    """The call's priority: the body's, or the tenant's default; 400 naming `priority` when the body asks
    for one more urgent than the tenant's `min_priority` (a quota field an admin sets)."""
    if body.priority is None:
        return caller.share.priority
    if body.priority < caller.share.min_priority:
        raise invalid_request(f"priority {body.priority} is more urgent than this tenant may ask for: the lowest "
                              f"allowed is {caller.share.min_priority} (an admin sets it: quota.min_priority).",
                              param="priority")
    return body.priority


def sampling_params(vocab: int, body: ChatCompletionRequest | CompletionRequest, num_prompts: int,
                    max_tokens: int, priority: int = 0) -> list[SamplingParams]:
    """One SamplingParams per sequence (choice j of a prompt gets seed + j, wrapped to 64 bits), checked
    against the model. max_tokens 0 (`Completion.echo_only`) runs 1; `echo` with `logprobs` asks for the
    prompt's (`prompt_logprobs`, as vLLM maps it) on each prompt's first choice only: its n choices share
    one scoring of the prompt, and the others may take it from the prefix cache (each choice scoring it
    computed the prompt n times over, and charged once)."""
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    try:
        top_k = -1 if body.top_k is None else check_top_k(body.top_k, vocab)
        stop_token_ids = check_stop_token_ids(body.stop_token_ids, vocab)
        return [SamplingParams(max_tokens=max(1, max_tokens), temperature=1.0 if body.temperature is None else
                               body.temperature, top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
                               seed=None if body.seed is None else (body.seed + j + 2**63) % 2**64 - 2**63,
                               stop=body.stop,
                               stop_token_ids=stop_token_ids, ignore_eos=bool(body.ignore_eos), priority=priority,
                               logprobs=body.num_logprobs, json_schema=body.json_schema,
                               prompt_logprobs=body.num_logprobs if echo and j == 0 else None)
                for _ in range(num_prompts) for j in range(body.n)]
    except ParamError as e:
        raise invalid_request(str(e), param=e.param) from None


async def wait_or_disconnect(request: Request, gen: Generation) -> bool:
    """Wait for the result; False (engine requests aborted) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    done_task = asyncio.ensure_future(gen.wait())
    try:
        done, _ = await asyncio.wait({watcher, done_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        gen.cancel()
        raise
    finally:
        watcher.cancel()
    if done_task not in done:
        gen.cancel()
        return False
    return True
