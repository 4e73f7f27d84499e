"""A completion's answer: the JSON body (`response_body`, through the pydantic models of
`openai_responses`), the SSE stream in OpenAI's chunk format (`stream`), and what a request the engine
ended early answers (503 `engine_error`, 400 `response_format` when its grammar failed while
generating, or `server_shutting_down` when shutdown's grace ran out).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from loraplex.engine.structured_output import GrammarError
from loraplex.platform.engine_client import Generation
from loraplex.platform.errors import (
    REPLICA_LOST,
    APIError,
    adapter_load_failed,
    invalid_request,
    replica_lost,
    shutting_down,
    unavailable,
)
from loraplex.platform.logprobs import TextOffsets, chat_content, completion_logprobs
from loraplex.platform.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    UsageBody,
)

if TYPE_CHECKING:
    from loraplex.platform.completion import Completion


def engine_error(message: str = "The engine failed while generating this request; try again.") -> APIError:
    """A request the engine ended for a fault of its own (not the input): 503, worth a retry."""
    return unavailable(message, code="engine_error")


def error_of(c: Completion, error: str | None, is_adapter_failure: bool) -> APIError:
    """The answer for a choice the engine ended early: its error, or shutdown when it has none."""
    if error is None:  # aborted by the gateway with no fault: shutdown's grace ran out
        return shutting_down()
    if error.startswith(f"{REPLICA_LOST}: "):
        return replica_lost()
    if error.startswith(f"{GrammarError.__name__}: "):  # the schema's fault, and a retry fails the same way
        return invalid_request(f"The response_format's grammar failed while generating: "
                               f"{error.split(': ', 1)[1]}. Simplify the schema.", param="response_format")
    # the engine's reason reads "adapter '<engine name>' could not be ...: <why>": the tenant sees its own name
    return adapter_load_failed(c.adapter, error.split(": ", 1)[-1]) if is_adapter_failure else engine_error()


def _raise_for_errors(c: Completion, gen: Generation) -> None:
    for ch in gen.choices:
        if ch.error is not None or ch.finish_reason == "abort":
            raise error_of(c, ch.error, ch.adapter_failed)


def usage_body(c: Completion, gen: Generation) -> UsageBody:
    n = c.num_completion_tokens(gen)
    return UsageBody(prompt_tokens=c.num_prompt_tokens, completion_tokens=n, total_tokens=c.num_prompt_tokens + n,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.num_cached_tokens(c.body.n)))


def response_body(c: Completion, gen: Generation) -> ChatCompletion | TextCompletion:
    _raise_for_errors(c, gen)
    tokenizer, asked = gen.service.tokenizer, c.body.num_logprobs is not None
    if c.kind == "chat":
        return ChatCompletion(id=c.request_id, created=c.created, model=c.body.model, usage=usage_body(c, gen),
                              choices=[ChatChoice(index=i, message=AssistantMessage(content=ch.text),
                                                  logprobs=ChatLogprobs(content=chat_content(tokenizer, ch.logprobs))
                                                  if asked else None, finish_reason=ch.finish_reason)
                                       for i, ch in enumerate(gen.choices)])
    echoed = prompt_texts(c, tokenizer) if c.echo else None
    choices = []
    for i, ch in enumerate(gen.choices):
        text, lps, finish_reason = ch.text, ch.logprobs, ch.finish_reason
        if c.echo_only:
            text, lps, finish_reason = "", [], "length"
        if echoed is not None:
            prompt = echoed[i // c.body.n]
            logprobs = None
            if asked:  # the prompt's entries, then the completion's, two texts decoded apart (`TextOffsets`)
                scored = gen.choices[i - i % c.body.n].prompt_logprobs  # its prompt's first choice scored it
                offsets = TextOffsets()
                entries = completion_logprobs(tokenizer, echoed_logprobs(c, i, scored), offsets)
                offsets.flush()
                logprobs = _joined(entries, completion_logprobs(tokenizer, lps, offsets))
            text = prompt + text
        else:
            logprobs = completion_logprobs(tokenizer, lps) if asked else None
        choices.append(TextChoice(index=i, text=text, finish_reason=finish_reason,
                                  logprobs=TextLogprobs(**logprobs) if asked else None))
    return TextCompletion(id=c.request_id, created=c.created, model=c.body.model, usage=usage_body(c, gen),
                          choices=choices)


def prompt_texts(c: Completion, tokenizer) -> list[str]:
    """Each prompt as `echo` returns it: a text prompt as sent, token ids decoded (vLLM's echo)."""
    p = c.body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    return [text if isinstance(text, str) else tokenizer.decode(ids) for text, ids in zip(p, c.prompts, strict=True)]


def echoed_logprobs(c: Completion, i: int, prompt_logprobs: list) -> list:
    """Choice i's prompt entries for `completion_logprobs`: its first token as a bare id (no
    log-probability), then the engine's `prompt_logprobs` of the others (those of its prompt's first
    choice: only that one asks the engine, `completion.sampling_params`)."""
    prompt = c.prompts[i // c.body.n]
    return [prompt[0], *prompt_logprobs[1:]]


def _joined(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(c: Completion, gen: Generation, finalized: asyncio.Task):
    """SSE chunks in OpenAI's format, ending with `data: [DONE]`; the usage chunk (stream_options) after
    `finalized` (the quota settled). Leaving early aborts the engine requests."""
    is_chat = c.kind == "chat"
    opts = c.body.stream_options
    include_usage = bool(opts and opts.include_usage)
    base = {"id": c.request_id, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": c.created, "model": c.body.model, "system_fingerprint": None}
    # Every chunk is json.dumps({**base, "choices": [choice], "usage": None if include_usage}), byte for
    # byte; the call's constant part is serialized once, each token only its choice.
    head = f"data: {json.dumps(base)[:-1]}, \"choices\": ["
    tail = ("], \"usage\": null}" if include_usage else "]}") + "\n\n"

    tokenizer, asked = gen.service.tokenizer, c.body.num_logprobs is not None
    pending: list[list] = [[] for _ in gen.choices]  # per choice: logprobs of tokens not yet in a chunk
    offsets = [TextOffsets() for _ in gen.choices]  # per choice: completions' text_offset so far
    # echo: each choice's prompt goes first, in a chunk of its own with its first output; with logprobs,
    # once its prompt's first choice (the one that scores the prompt) has had its first output
    echoed = prompt_texts(c, tokenizer) if c.echo else None
    to_echo = set(range(len(gen.choices))) if c.echo else set()
    n = c.body.n
    scores: dict[int, list] = {}  # a prompt's first choice -> its prompt log-probabilities
    held: dict[int, list] = {}  # choice -> its outputs that wait for its prompt's scores
    failed: dict[int, str] = {}  # choice -> the error event sent for it (nothing more is sent for it)

    def chunk(i: int, text: str | None, finish_reason: str | None, role: bool = False) -> str:
        logprobs = None
        if asked and not role and (pending[i] or finish_reason is None):
            lps, pending[i] = pending[i], []
            logprobs = ({"content": chat_content(tokenizer, lps)} if is_chat
                        else completion_logprobs(tokenizer, lps, offsets[i]))
        if is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return head + json.dumps(choice) + tail

    def fail_with(j: int, first: int, parts: list[str]) -> None:
        """End choice j with the error of its prompt's first choice, which failed before scoring the prompt;
        its engine request is aborted (it would run, and be charged, for an answer nobody gets)."""
        failed[j] = failed[first]
        parts.append(failed[j])
        gen.service.abort_nowait(gen.request_ids[j])

    def deliver(i: int, out, parts: list[str]) -> None:
        """Append to `parts` the chunks of choice i's output `out` (or hold it for its prompt's scores)."""
        if i in failed:
            return
        first = i - i % n
        if out.finish_reason == "abort":
            failed[i] = _sse(error_of(c, out.error, out.adapter_failed).body())
            parts.append(failed[i])
            held.pop(i, None)
            if i == first and c.echo and asked and first not in scores:  # its other choices get no scores
                for j in range(first + 1, first + n):
                    if j in to_echo and j not in failed:
                        held.pop(j, None)
                        fail_with(j, first, parts)
            return
        if i in held:
            held[i].append(out)
            return
        if i in to_echo:
            if asked and i == first:
                scores[i] = out.prompt_logprobs
            elif asked and first not in scores:
                if first in failed:
                    fail_with(i, first, parts)
                else:
                    held[i] = [out]
                return
            to_echo.discard(i)
            prompt = echoed[i // n]
            if asked:
                pending[i] = echoed_logprobs(c, i, scores[first])
            parts.append(chunk(i, prompt, None))
            offsets[i].flush()  # the completion is decoded apart from the prompt
        if c.echo_only:  # the one token the engine sampled is not part of the answer
            if out.finished:
                parts.append(chunk(i, None, "length"))
        else:
            if asked:
                pending[i] += out.delta_logprobs or []
            if out.delta_text:
                parts.append(chunk(i, out.delta_text, None))
            if out.finished:
                parts.append(chunk(i, None, out.finish_reason))
        if i == first and asked and c.echo:  # its scores are here: what waited for them goes out
            for j in [j for j in held if j - j % n == first]:
                for o in held.pop(j):
                    deliver(j, o, parts)

    try:
        if is_chat:
            yield "".join(chunk(i, None, None, role=True) for i in range(len(gen.choices)))
        async for batch in gen.batches():  # one write per wake-up: a step's deltas of every choice
            parts = []
            for i, out in batch:
                deliver(i, out, parts)
            if parts:
                yield "".join(parts)
        await asyncio.shield(finalized)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage_body(c, gen).model_dump()})
        yield _sse("[DONE]")
    finally:
        gen.cancel()
