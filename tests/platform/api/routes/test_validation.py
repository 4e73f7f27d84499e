"""Every bound and refusal of the OpenAI endpoints over real HTTP: status, `param` and message exactly.

The shared server runs the default settings; `strict` is a second app on the same engine with small
limits, so that the limits that are settings are seen at their edges.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.platform import factories
from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2's
CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": BASE_MODEL, "prompt": "One, two,", "max_tokens": 4}


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, message", [
    ({"top_k": 10**30}, "top_k", f"top_k must be -1 or 0 (off) or an integer in [1, {VOCAB}], got {10**30}"),
    ({"top_k": VOCAB + 1}, "top_k", f"top_k must be -1 or 0 (off) or an integer in [1, {VOCAB}], got {VOCAB + 1}"),
    ({"top_k": -5}, "top_k", f"top_k must be -1 or 0 (off) or an integer in [1, {VOCAB}], got -5"),
    ({"temperature": 3}, "temperature", "temperature must be a number in [0, 2], got 3.0"),
    ({"temperature": float("nan")}, "temperature", "temperature must be a number in [0, 2], got nan"),
    ({"top_p": float("inf")}, "top_p", "top_p must be a number in (0, 1], got inf"),
    ({"presence_penalty": float("-inf")}, "presence_penalty", "`presence_penalty` is not supported by loraplex"),
    ({"top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0.0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", "max_completion_tokens must be an integer >= 1, got -1"),
    ({"n": 0}, "n", "n must be an integer in [1, 16], got 0."),
    ({"n": 17}, "n", "n must be an integer in [1, 16], got 17."),
    ({"seed": 2**64}, "seed", f"seed must be an integer in [-2**63, 2**63 - 1], got {2**64}"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "stop takes at most 16 strings, got 17"),
    ({"stop": "x" * 257}, "stop", "each stop string has at most 256 characters, got one of 257"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", f"stop_token_ids must be token ids in [0, {VOCAB}), got {VOCAB}"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "`logit_bias` is not supported by loraplex"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "`frequency_penalty` is not supported by loraplex"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "`tools` is not supported by loraplex"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be an integer in [0, 20], got 21"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": 1}, "logprobs", "logprobs: Input should be a valid boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options is only allowed with stream: true"),
    ({"response_format": {"type": "json"}}, "response_format",
     "response_format.type must be one of 'text', 'json_object', 'json_schema', got 'json'"),
    ({"response_format": "json"}, "response_format", "response_format: Input should be a valid dictionary"),
    ({"max_tokens": 100_000}, "max_tokens", None),  # context: see test_chat
    ({"priority": 2**31}, "priority", f"priority must be an integer in [-2**31, 2**31 - 1], got {2**31}"),
    ({"priority": -1}, "priority", "priority -1 is more urgent than this tenant may ask for: the lowest allowed is "
                                   "0 (an admin sets it: quota.min_priority)."),
    ({"priority": 1.5}, "priority", "priority: Input should be a valid integer"),
    ({"n": "2"}, "n", "n: Input should be a valid integer"),  # "n" is a letter of the message, not its name
    ({"n": 2.5}, "n", "n: Input should be a valid integer"),
    # types are strict, as OpenAI's: no string or boolean stands in for a number, no number for a boolean
    ({"temperature": "1"}, "temperature", "temperature: Input should be a valid number"),
    ({"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ({"stop_token_ids": [True]}, "stop_token_ids.0", "stop_token_ids.0: Input should be a valid integer"),
    ({"stop": 123}, "stop", "stop: Input should be a valid string (and 1 more problem)"),
    ({"stop": "\ud800"}, "stop", "stop contains a lone UTF-16 surrogate ('\\ud800' at index 0), which is not valid Unicode"),
    ({"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages.0.content",
     "messages contains a lone UTF-16 surrogate ('\\udfff' at index 1), which is not valid Unicode"),
    ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages.0.name",
     "messages contains a lone UTF-16 surrogate ('\\ud800' at index 0), which is not valid Unicode"),
    ({"messages": [{"role": "user"}]}, "messages.0", "messages.0: a user message needs `content`"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content",
     "messages.0.content: content is an empty list: send a string or at least one text part"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "messages.0",
     "messages.0: a system message needs `content`"),
])
def test_chat_refusals_name_the_field_and_the_range(make_tenant, body, param, message):
    t = make_tenant()
    # json.dumps writes NaN and Infinity as Python's json module reads them (httpx's json= refuses to)
    r = t.client.post("/v1/chat/completions", content=json.dumps({**CHAT, **body}),
                      headers={"content-type": "application/json"})
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if message is not None:
        assert err["message"] == message


@pytest.mark.parametrize("body, param, message", [
    ({"presence_penalty": 0.5}, "presence_penalty", "`presence_penalty` is not supported by loraplex"),
    ({"modalities": ["text", "audio"]}, "modalities", "`modalities` is not supported by loraplex"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "`reasoning_effort` is not supported by loraplex"),
    ({"web_search_options": {}}, "web_search_options", "`web_search_options` is not supported by loraplex"),
    ({"service_tier": "flex"}, "service_tier", "service_tier 'flex' is not supported by loraplex: every call runs "
                                               "at \"default\" (a tenant's urgency is loraplex's `priority` field)"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages.0.content", "messages.0.content: content parts of type 'image_url' are not supported by loraplex: the model takes text "
                           "only (parts of type \"text\")"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
     "messages.1.tool_calls", "assistant messages with `tool_calls` are not supported by loraplex (it has no tool "
                              "calling)"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
                   {"role": "user", "content": "hi"}]},
     "messages.0.function_call", "assistant messages with `function_call` are not supported by loraplex (it has no "
                                 "tool calling)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     "messages.1.role", "tool messages are not supported by loraplex (it has no tool calling)"),
])
def test_unsupported_parameters_are_refused_with_openais_code(make_tenant, body, param, message):
    """A field loraplex does not honour, with a value that would change the answer, is a 400 naming it with
    code `unsupported_parameter` (OpenAI's), never silently ignored."""
    t = make_tenant()
    err = error_of(t.client.post("/v1/chat/completions", json={**CHAT, **body}))
    assert err == {"message": message, "type": "invalid_request_error", "param": param,
                   "code": "unsupported_parameter"}


def test_nulls_and_neutral_values_of_openais_other_fields_are_accepted(make_tenant):
    """What OpenAI's API takes as null, and fields that change nothing here: stream and echo null,
    service_tier auto or default, modalities text, reasoning_effort none, store (nothing is stored, as in
    vLLM), metadata, parallel_tool_calls."""
    t = make_tenant()
    body = {**CHAT, "stream": None, "service_tier": "auto", "modalities": ["text"], "store": True,
            "metadata": {"run": "7"}, "parallel_tool_calls": True, "reasoning_effort": "none"}
    r = t.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    r = t.client.post("/v1/completions", json={**COMPLETION, "stream": None, "echo": None, "service_tier": "default"})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text


def test_text_parts_are_one_per_line_as_in_vllm(make_tenant):
    t = make_tenant()

    def call(content):
        r = t.client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["message"]["content"]

    parts = call([{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}])
    assert parts == call("Say\nhi") and parts[0] != call("Sayhi")[0]


def test_neutral_values_of_unsupported_fields_are_accepted(make_tenant):
    t = make_tenant()
    body = {**CHAT, "temperature": 0, "n": None, "top_k": 0, "logit_bias": {}, "frequency_penalty": 0, "tools": [],
            "ignore_eos": None, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"},
                                             {"role": "user", "content": "again", "name": "ann"}],
            "tool_choice": "none", "logprobs": False, "response_format": {"type": "text"}, "seed": -(2**63),
            "stop_token_ids": [VOCAB - 1], "unknown_field": 1}
    r = t.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param, message", [
    ({"echo": 1}, "echo", "echo: Input should be a valid boolean"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0 (0 is allowed with echo: true, to "
                                      "score the prompt alone)."),
    ({"suffix": "x"}, "suffix", "`suffix` is not supported by loraplex"),
    ({"logprobs": 6}, "logprobs", "logprobs must be an integer in [0, 5], got 6"),
    ({"best_of": 3}, "best_of", "`best_of` other than 1 or n is not supported by loraplex"),
    ({"prompt": [[1, 2], [3, VOCAB]]}, "prompt", f"Token ids must be in [0, {VOCAB})."),
    ({"prompt": ["ok", "\ud800"]}, "prompt",
     "prompt contains a lone UTF-16 surrogate ('\\ud800' at index 0), which is not valid Unicode"),
    ({"prompt": [True, 2]}, "prompt", "prompt: Input should be a valid string (and 5 more problems)"),
])
def test_completion_refusals_name_the_field(make_tenant, body, param, message):
    t = make_tenant()
    err = error_of(t.client.post("/v1/completions", content=json.dumps({**COMPLETION, **body}),
                                 headers={"content-type": "application/json"}))
    assert (err["param"], err["message"]) == (param, message)


def test_a_hostile_fan_out_is_refused_at_once(make_tenant):
    """1,000 prompts x n 16 used to fan out to 16,000 sequences and no answer came within 30 s."""
    t = make_tenant()
    started = time.monotonic()
    err = error_of(t.client.post("/v1/completions", json={**COMPLETION, "prompt": ["Hello"] * 1000, "n": 16}))
    assert time.monotonic() - started < 5
    assert err == {"message": "The prompt list has 1000 prompts; at most 64 are allowed per request.",
                   "type": "invalid_request_error", "param": "prompt", "code": None}
    err = error_of(t.client.post("/v1/completions", json={**COMPLETION, "prompt": ["Hello"] * 10, "n": 16}))
    assert err["param"] == "n"
    assert err["message"] == "n x prompts is 16 x 10 = 160 sequences; at most 64 are allowed per request."
    # prompt tokens per call (default 65,536): nine prompts of 7,300 token ids, each within the context
    err = error_of(t.client.post("/v1/completions", json={**COMPLETION, "prompt": [[5] * 7300] * 9}))
    assert err["param"] == "prompt"
    assert err["message"] == "The prompts have 65700 tokens; at most 65536 are allowed per request."


@pytest.fixture(scope="module")
def strict(make_settings, start_app, redis_db, admin):
    """An app on the shared engine with small per-call limits."""
    server = start_app(make_settings(redis_url=redis_db(), max_n=2, max_sequences_per_request=4,
                                     max_prompt_tokens_per_request=100, max_tokens_limit=8, max_request_bytes=4096))
    with factories.client(server.url, server.settings.admin_key.get_secret_value()) as c:
        tenant = factories.make_tenant(c, server.url)
    yield tenant
    tenant.client.close()


@pytest.mark.parametrize("body, param, message", [
    ({"n": 3}, "n", "n must be an integer in [1, 2], got 3."),
    ({"prompt": ["a"] * 5}, "prompt", "The prompt list has 5 prompts; at most 4 are allowed per request."),
    ({"prompt": ["a"] * 3, "n": 2}, "n", "n x prompts is 2 x 3 = 6 sequences; at most 4 are allowed per request."),
    ({"prompt": [[7] * 51, [7] * 50]}, "prompt", "The prompts have 101 tokens; at most 100 are allowed per request."),
    ({"max_tokens": 9}, "max_tokens", "max_tokens is 9; at most 8 tokens are allowed per choice."),
])
def test_per_call_limits_are_settings(strict, body, param, message):
    err = error_of(strict.client.post("/v1/completions", json={**COMPLETION, **body}))
    assert (err["param"], err["message"]) == (param, message)


def test_limits_themselves_are_admitted(strict):
    r = strict.client.post("/v1/completions", json={**COMPLETION, "prompt": [[7] * 50, [7] * 50], "n": 2,
                                                    "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [len(c["text"]) > 0 for c in r.json()["choices"]] == [True] * 4
    assert r.json()["usage"]["completion_tokens"] == 32
    r = strict.client.post("/v1/completions", json={**COMPLETION, "max_tokens": None, "ignore_eos": True,
                                                    "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 8  # the default max_tokens is capped at the limit


@pytest.mark.parametrize("body, message", [
    ('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "The request body is not valid JSON: it is nested too deeply to parse."),
    ('{"model": "x",', "The request body is not valid JSON: Expecting property name enclosed in double quotes"),
], ids=["nested-too-deeply", "cut-short"])
def test_a_body_that_is_not_json_gets_a_400_that_says_so(make_tenant, body, message):
    t = make_tenant()
    err = error_of(t.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}))
    assert err == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    assert t.chat(max_tokens=1).status_code == 200  # and the server goes on


def test_a_body_over_the_limit_is_413_declared_or_chunked(strict):
    big = {**COMPLETION, "prompt": "x" * 5000}
    err = error_of(strict.client.post("/v1/completions", json=big), 413)
    assert err == {"message": "The request body exceeds the limit of 4096 bytes.", "type": "invalid_request_error",
                   "param": None, "code": "request_too_large"}

    def chunks():
        for _ in range(10):
            yield b" " * 1000
        yield b'{"model": "x"}'

    r = strict.client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"


def test_a_fan_out_holds_one_concurrency_slot_per_sequence(make_tenant):
    t = make_tenant(max_concurrent_requests=2)
    err = error_of(t.chat(n=3), 429)
    assert err == {"message": "Request too large for concurrent requests: Limit 2, Requested 3 sequences (n x "
                              "prompts). Reduce n or the prompt list.", "type": "requests", "param": "n",
                   "code": "rate_limit_exceeded"}
    assert t.chat(n=2).status_code == 200
    r = t.client.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]})
    assert error_of(r, 429)["param"] == "prompt"  # n is 1: the prompt list is what is too large


def test_a_fan_out_reserves_tokens_per_sequence(make_tenant, tokenizer):
    """Each sequence reserves its prompt and max_tokens against TPM; the charge is the usage reported."""
    from tests.helpers import chat_ids

    num_prompt = len(chat_ids(tokenizer, "Say hi"))
    tpm = 4 * (num_prompt + 10)
    t = make_tenant(tpm=tpm)
    err = error_of(t.chat(n=5, max_tokens=10), 429)
    assert err["message"].startswith(f"Request too large for tokens per min (TPM): Limit {tpm}, Requested "
                                     f"{5 * (num_prompt + 10)} (prompt + max_tokens).")
    r = t.chat(n=4, max_tokens=10)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == num_prompt  # counted once in usage, as OpenAI does
