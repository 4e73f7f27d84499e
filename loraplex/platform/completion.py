"""What chat and text completions share: model lookup, limits, admission, the engine run, responses.

Order for every request: resolve `model` (404 for anything not the base model or the caller's own
adapter), check lengths, reserve quota (429 before the engine sees anything), register the adapter
if needed, run. A detached task waits for the engine requests to end, then refunds unused tokens,
records usage and metrics: it runs whether the client stayed, left, or the engine failed.
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
from loraplex.engine.request import SamplingParams
from loraplex.platform import crud, tenant_adapters
from loraplex.platform.api.deps import QuotaGate
from loraplex.platform.engine import Generation, engine_adapter_name
from loraplex.platform.errors import APIError, invalid_request, model_not_found
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
    def endpoint(self) -> str:
        return "chat.completions" if self.kind == "chat" else "completions"


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
        raise APIError(500, f"The adapter `{row.name}` could not be loaded: its files are missing.",
                       type="server_error", code="adapter_load_failed")
    plan.adapter = row.name
    plan.engine_adapter = engine_adapter_name(tenant_id, row.name, row.digest)
    plan.adapter_path = str(path)


def check_lengths(gw: Gateway, plan: Plan, default_max_tokens: int) -> None:
    body, eng = plan.body, gw.engine
    prompt_param = "messages" if plan.kind == "chat" else "prompt"
    context = min(eng.max_model_len, eng.kv_capacity_tokens)
    longest = max(len(p) for p in plan.prompts)
    if longest >= context:
        raise invalid_request(f"The prompt has {longest} tokens; this model's context is {context} tokens.",
                              param=prompt_param, code="context_length_exceeded")
    if any(t < 0 or t >= eng.model_config.vocab_size for p in plan.prompts for t in p):
        raise invalid_request(f"Token ids must be in [0, {eng.model_config.vocab_size}).", param="prompt")
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = context - longest
    if requested is not None and requested > room:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise invalid_request(f"{param} is {requested}, but the prompt ({longest} tokens) leaves room for "
                              f"{room} tokens in this model's context of {context} tokens.", param=param,
                              code="context_length_exceeded")
    plan.max_tokens = requested if requested is not None else min(default_max_tokens, room)


def sampling_params(plan: Plan) -> list[SamplingParams]:
    body = plan.body
    params = []
    for _ in plan.prompts:
        for j in range(body.n):
            try:
                params.append(SamplingParams(
                    max_tokens=plan.max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or -1,
                    seed=None if body.seed is None else body.seed + j, stop=body.stop,
                    ignore_eos=body.ignore_eos))
            except ValueError as e:
                raise invalid_request(str(e)) from None
    return params


async def run(request: Request, gw: Gateway, gate: QuotaGate, plan: Plan) -> Response:
    """Check, admit, run and answer one call (JSON or an SSE stream). `plan.prompts` is set and the
    model resolved; the adapter, if any, is held until `finalize` (or an error here) releases it."""
    if plan.engine_adapter is not None:
        gw.engine.hold(plan.engine_adapter)
    try:
        check_lengths(gw, plan, gw.settings.default_max_tokens)
        return await _run(request, gw, gate, plan)
    except BaseException:
        if plan.engine_adapter is not None and not plan.is_running:
            gw.engine.release(plan.engine_adapter)
        raise


async def _run(request: Request, gw: Gateway, gate: QuotaGate, plan: Plan) -> Response:
    body, caller = plan.body, gate.caller
    plan.request_id = f"{'chatcmpl' if plan.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    plan.created = int(time.time())
    num_choices = len(plan.prompts) * body.n
    cost = plan.num_prompt_tokens + num_choices * plan.max_tokens
    try:
        ticket = await gate.admit(cost, plan.request_id)
    except APIError as e:
        gw.metrics.observe_request(caller.tenant_name, plan.endpoint, str(e.status_code))
        raise
    try:
        if plan.engine_adapter is not None:
            await gw.engine.ensure_adapter(plan.engine_adapter, plan.adapter_path)
        prompts = [p for p in plan.prompts for _ in range(body.n)]
        gen = Generation(gw.engine, prompts, sampling_params(plan), plan.engine_adapter, plan.request_id,
                         caller.tenant_id)
    except BaseException as exc:
        gw.spawn(gw.quotas.settle(ticket, 0))
        if isinstance(exc, AdapterError):
            raise APIError(500, f"The adapter `{plan.adapter}` could not be loaded: {exc}",
                           type="server_error", code="adapter_load_failed") from None
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
    elif gen.is_cancelled:
        status = "aborted"
    else:
        status = "ok" if all(c.finish_reason in ("stop", "length") for c in gen.choices) else "error"
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


def _raise_for_errors(gen: Generation) -> None:
    for c in gen.choices:
        if isinstance(c.error, ValueError):
            raise invalid_request(f"The engine refused the request: {c.error}")
        if c.error is not None or c.finish_reason == "abort":
            raise APIError(500, "The engine failed while generating; try again.", type="server_error",
                           code="engine_error")


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
            if isinstance(out, Exception) or out.finish_reason == "abort":
                err = APIError(500, "The engine failed while generating.", type="server_error",
                               code="engine_error")
                yield _sse(err.body())
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
