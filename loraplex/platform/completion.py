"""What chat and text completions share: model lookup, limits, admission, the engine run, responses.

Order for every request, each step refusing before the next costs anything: refuse while the gateway
shuts down or the engine's queue is full (503, before the body is read: `middleware.ShedMiddleware`);
resolve `model` (404 for anything not the base model or the caller's own adapter);
bound the fan-out (`n`, prompts, sequences: 400 before tokenizing); tokenize off the event loop; check
lengths and sampling values against the model (400 naming the field); reserve quota (429); register the
adapter if needed; queue the call's engine requests all or none (503 `server_overloaded` when the
engine's waiting queue has no room, by count, tokens or estimated wait; the reservation is refunded). A detached task waits for the engine requests to end, then refunds
unused tokens, records usage and metrics: it runs whether the client stayed, left, or the engine failed.
A request the engine ended for a fault of its own answers 503 `engine_error` with retry-after.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.adapters.peft import AdapterError
from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.sampling_params import ParamError, SamplingParams, check_stop_token_ids, check_top_k
from loraplex.platform import crud, tenant_adapters
from loraplex.platform.api.deps import Caller, QuotaGate
from loraplex.platform.engine_client import Generation, engine_adapter_name
from loraplex.platform.errors import (
    APIError,
    engine_overloaded,
    invalid_request,
    model_not_found,
    shutting_down,
    unavailable,
)
from loraplex.platform.gateway import Gateway
from loraplex.platform.openai_schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.quotas.service import Ticket
from loraplex.platform.usage import Usage


@dataclass
class Plan:
    """One API call, checked and ready for the engine."""

    kind: str  # "chat" or "completion"
    body: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]  # distinct prompts; each runs body.n times
    adapter: str | None = None  # the tenant's name for it
    engine_adapter: str | None = None
    adapter_path: str | None = None
    max_tokens: int = 16
    request_id: str = ""
    created: int = 0
    is_running: bool = False
    finalized: asyncio.Task | None = None  # refund, usage and metrics; responses end after it

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.body.n

    @property
    def endpoint(self) -> str:
        return "chat.completions" if self.kind == "chat" else "completions"

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def overloaded_answer(gw: Gateway, caller: Caller, plan: Plan, retry_after_s: float = 1.0) -> APIError:
    """The 503 for a call the engine shed because its queue has no room, counted in /metrics."""
    gw.metrics.observe_shed("engine_queue_full")
    gw.metrics.observe_request(caller.tenant_name, plan.endpoint, "503")
    return engine_overloaded(retry_after_s)


async def resolve_model(gw: Gateway, tenant_id: int, plan: Plan) -> None:
    model = plan.body.model
    if model == gw.engine.model_id:
        return

    def lookup():
        with gw.sessions() as s:
            row = crud.get_adapter(s, tenant_id, model)
        if row is None:
            return None, None
        try:
            return row, tenant_adapters.adapter_dir(gw, row)
        except KeyError:
            return row, None

    row, path = await asyncio.to_thread(lookup)
    if row is None:
        raise model_not_found(model)
    if path is None:
        raise unavailable(f"The adapter `{row.name}` could not be loaded: its files are missing.",
                          code="adapter_load_failed")
    plan.adapter = row.name
    plan.engine_adapter = engine_adapter_name(tenant_id, row.name, row.digest)
    plan.adapter_path = str(path)


def check_fan_out(gw: Gateway, plan: Plan, num_prompts: int) -> None:
    """`n`, the prompt list and n x prompts against the settings, before anything is tokenized."""
    settings, n = gw.settings, plan.body.n
    if not 1 <= n <= settings.max_n:
        raise invalid_request(f"n must be an integer in [1, {settings.max_n}], got {n}.", param="n")
    limit = settings.max_sequences_per_request
    if num_prompts > limit:
        raise invalid_request(f"The prompt list has {num_prompts} prompts; at most {limit} are allowed per "
                              "request.", param=plan.prompt_param)
    if n * num_prompts > limit:
        raise invalid_request(f"n x prompts is {n} x {num_prompts} = {n * num_prompts} sequences; at most {limit} "
                              "are allowed per request.", param="n")


def check_lengths(gw: Gateway, plan: Plan) -> None:
    """Prompt tokens per call, the context and max_tokens; sets `plan.max_tokens`."""
    body, eng, settings = plan.body, gw.engine, gw.settings
    total = plan.num_prompt_tokens
    if total > settings.max_prompt_tokens_per_request:
        raise invalid_request(f"The prompts have {total} tokens; at most {settings.max_prompt_tokens_per_request} "
                              "are allowed per request.", param=plan.prompt_param)
    context = min(eng.max_model_len, eng.kv_capacity_tokens)
    longest = max(len(p) for p in plan.prompts)
    if longest >= context:
        raise invalid_request(f"The prompt has {longest} tokens; this model's context is {context} tokens.",
                              param=plan.prompt_param, code="context_length_exceeded")
    vocab = eng.model_config.vocab_size
    if any(t < 0 or t >= vocab for p in plan.prompts for t in p):
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
    if requested is None:
        requested = min(settings.default_max_tokens, room, cap or room)
    plan.max_tokens = requested


def sampling_params(gw: Gateway, plan: Plan) -> list[SamplingParams]:
    """One SamplingParams per sequence (choice j of a prompt gets seed + j, wrapped to 64 bits), checked
    against the model."""
    body = plan.body
    vocab = gw.engine.model_config.vocab_size
    try:
        top_k = -1 if body.top_k is None else check_top_k(body.top_k, vocab)
        stop_token_ids = check_stop_token_ids(body.stop_token_ids, vocab)
        return [SamplingParams(max_tokens=plan.max_tokens, temperature=1.0 if body.temperature is None else
                               body.temperature, top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
                               seed=None if body.seed is None else (body.seed + j + 2**63) % 2**64 - 2**63,
                               stop=body.stop,
                               stop_token_ids=stop_token_ids, ignore_eos=body.ignore_eos)
                for _ in plan.prompts for j in range(body.n)]
    except ParamError as e:
        raise invalid_request(str(e), param=e.param) from None


async def run(request: Request, gw: Gateway, gate: QuotaGate, plan: Plan) -> Response:
    """Check, admit, run and answer one call (JSON or an SSE stream). `plan.prompts` is set and the
    model resolved; the adapter, if any, is held until `finalize` (or an error here) releases it."""
    if plan.engine_adapter is not None:
        gw.engine.hold(plan.engine_adapter)
    try:
        check_lengths(gw, plan)
        params = sampling_params(gw, plan)
        return await _run(request, gw, gate, plan, params)
    except BaseException:
        if plan.engine_adapter is not None and not plan.is_running:
            gw.engine.release(plan.engine_adapter)
        raise


async def _run(request: Request, gw: Gateway, gate: QuotaGate, plan: Plan, params: list[SamplingParams]) -> Response:
    body, caller = plan.body, gate.caller
    plan.request_id = f"{'chatcmpl' if plan.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    plan.created = int(time.time())
    # Admission counts the call as the sequences it runs: each reserves its prompt and max_tokens and holds
    # a concurrency slot. The refund at the end brings the charge down to the usage reported.
    cost = body.n * plan.num_prompt_tokens + plan.num_sequences * plan.max_tokens
    try:
        ticket = await gate.admit(cost, plan.request_id, plan.num_sequences,
                                  "n" if body.n > 1 else plan.prompt_param)
    except APIError as e:
        gw.metrics.observe_request(caller.tenant_name, plan.endpoint, str(e.status_code))
        raise
    try:
        if plan.engine_adapter is not None:
            await gw.engine.ensure_adapter(plan.engine_adapter, plan.adapter_path)
        prompts = [p for p in plan.prompts for _ in range(body.n)]
        try:
            gen = await Generation.start(gw.engine, prompts, params, plan.engine_adapter, plan.request_id,
                                         caller.tenant_id)
        finally:
            gw.engine.stop_admitting(request.scope.setdefault("state", {}))
    except BaseException as exc:  # nothing ran: the reservation, the slots and the RPM unit go back
        gw.spawn(gw.quotas.settle(ticket, 0, ran=False))
        if isinstance(exc, EngineOverloadedError):
            raise overloaded_answer(gw, caller, plan, exc.retry_after_s) from None
        if isinstance(exc, AdapterError):
            raise unavailable(f"The adapter `{plan.adapter}` could not be loaded: {exc}",
                              code="adapter_load_failed") from None
        if isinstance(exc, ValueError):
            raise invalid_request(f"The engine refused the request: {exc}", param=getattr(exc, "param", None)) from None
        raise
    plan.is_running = True  # from here on, finalize releases the adapter
    plan.finalized = gw.spawn(finalize(gw, gate, plan, gen, ticket))
    if body.stream:
        headers = {**ticket.headers, "cache-control": "no-cache", "x-request-id": plan.request_id}
        return StreamingResponse(stream(plan, gen), media_type="text/event-stream", headers=headers)
    if not await wait_or_disconnect(request, gen):
        return Response(status_code=499)  # nobody is listening
    await asyncio.shield(plan.finalized)  # the client sees its response after its quota is settled
    return JSONResponse(response_body(plan, gen), headers={**ticket.headers, "x-request-id": plan.request_id})


async def finalize(gw: Gateway, gate: QuotaGate, plan: Plan, gen: Generation, ticket: Ticket) -> None:
    await gen.wait()
    if plan.engine_adapter is not None:
        gw.engine.release(plan.engine_adapter)
    num_completion = gen.num_completion_tokens
    await gw.quotas.settle(ticket, plan.num_prompt_tokens + num_completion)
    if any(c.error is not None for c in gen.choices):
        status = "error"
    elif gen.is_cancelled or any(c.finish_reason == "abort" for c in gen.choices):
        status = "aborted"  # by the gateway: the client left, or shutdown's grace period ran out
    else:
        status = "ok"
    ttfts = [c.ttft_s for c in gen.choices if c.ttft_s is not None]
    latencies = [c.latency_s for c in gen.choices if c.latency_s is not None]
    caller = gate.caller
    gw.usage.record(Usage(request_id=plan.request_id, tenant_id=caller.tenant_id, api_key_id=caller.key_id,
                          adapter=plan.adapter, endpoint=plan.endpoint, status=status,
                          num_prompt_tokens=plan.num_prompt_tokens, num_completion_tokens=num_completion,
                          ttft_s=min(ttfts) if ttfts else None, latency_s=max(latencies) if latencies else None))
    gw.metrics.observe_request(caller.tenant_name, plan.endpoint, status)
    for i, c in enumerate(gen.choices):
        gw.metrics.observe_generation(caller.tenant_name, plan.num_prompt_tokens if i == 0 else 0,
                                      len(c.token_ids), c.ttft_s, c.latency_s)


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


def engine_error(message: str = "The engine failed while generating this request; try again.") -> APIError:
    """A request the engine ended for a fault of its own (not the input): 503, worth a retry."""
    return unavailable(message, code="engine_error")


def _raise_for_errors(gen: Generation) -> None:
    for c in gen.choices:
        if c.error is not None:
            raise engine_error()
        if c.finish_reason == "abort":  # aborted by the gateway with no fault: shutdown's grace ran out
            raise shutting_down()


def usage_body(plan: Plan, gen: Generation) -> dict:
    n = gen.num_completion_tokens
    return {"prompt_tokens": plan.num_prompt_tokens, "completion_tokens": n,
            "total_tokens": plan.num_prompt_tokens + n}


def response_body(plan: Plan, gen: Generation) -> dict:
    _raise_for_errors(gen)
    if plan.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(gen.choices)]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                   for i, c in enumerate(gen.choices)]
        obj = "text_completion"
    return {"id": plan.request_id, "object": obj, "created": plan.created, "model": plan.body.model,
            "system_fingerprint": None, "choices": choices, "usage": usage_body(plan, gen)}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(plan: Plan, gen: Generation):
    """SSE chunks in OpenAI's format, ending with `data: [DONE]`. Leaving early aborts the engine requests."""
    is_chat = plan.kind == "chat"
    opts = plan.body.stream_options
    include_usage = bool(opts and opts.include_usage)
    base = {"id": plan.request_id, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": plan.created, "model": plan.body.model, "system_fingerprint": None}
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, text: str | None, finish_reason: str | None, role: bool = False) -> str:
        if is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return _sse({**base, "choices": [choice], **extra})

    try:
        if is_chat:
            for i in range(len(gen.choices)):
                yield chunk(i, None, None, role=True)
        async for i, out in gen.events():
            if out.finish_reason == "abort":
                yield _sse((engine_error() if out.error is not None else shutting_down()).body())
                continue
            if out.delta_text:
                yield chunk(i, out.delta_text, None)
            if out.finished:
                yield chunk(i, None, out.finish_reason)
        await asyncio.shield(plan.finalized)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage_body(plan, gen)})
        yield _sse("[DONE]")
    finally:
        gen.cancel()
