"""POST /v1/completions: text prompts, token-id prompts, several prompts, streaming."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers import chat_ids
from tests.platform.factories import BASE_MODEL
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow


def complete(t, **body):
    return t.client.post("/v1/completions", json={"model": BASE_MODEL, "max_tokens": 4, "temperature": 0, **body})


def test_text_and_token_prompts_agree(make_tenant, gateway):
    t = make_tenant()
    r = complete(t, prompt="The capital of France is")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] <= 4
    ids = gateway.engine.encode("The capital of France is")
    same = complete(t, prompt=ids).json()
    assert same["choices"][0]["text"] == body["choices"][0]["text"]


def test_several_prompts_and_n(make_tenant):
    t = make_tenant()
    r = complete(t, prompt=["One, two,", "Red, green,"], n=2)
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] != choices[2]["text"]  # greedy: n copies agree


def test_stream(make_tenant):
    t = make_tenant()
    with t.client.stream("POST", "/v1/completions", json={"model": BASE_MODEL, "prompt": "One, two,",
                                                           "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == complete(t, prompt="One, two,").json()["choices"][0]["text"]


@pytest.mark.parametrize("body, param", [({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
                                         ({"prompt": [10**9]}, "prompt"), ({"prompt": "x", "max_tokens": 0}, "max_tokens")])
def test_bad_prompts(make_tenant, body, param):
    t = make_tenant()
    r = complete(t, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ignore_eos_generates_max_tokens(make_tenant, tokenizer):
    """vLLM's extension: EOS does not stop the row; streamed or not, it makes exactly max_tokens."""
    t = make_tenant()
    ids = chat_ids(tokenizer, "Say hi")  # the chat template: the model answers briefly, then EOS
    short = complete(t, prompt=ids, max_tokens=40).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40
    full = complete(t, prompt=ids, max_tokens=40, ignore_eos=True).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 40
    with t.client.stream("POST", "/v1/completions", json={"model": BASE_MODEL, "prompt": ids, "max_tokens": 40,
                                                           "temperature": 0, "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line and "[DONE]" not in line]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]


def test_open_streams_hold_no_database_connection(make_tenant, gateway, server):
    """Each open stream used to keep its request's database session until the stream ended (FastAPI runs
    a yield dependency's exit after the response): 16 streams at once exhausted SQLAlchemy's pool (5 + 10)
    and the 16th request waited 30 s for a connection before failing."""
    t = make_tenant(max_concurrent_requests=32)
    num_streams, started, results = 20, threading.Barrier(21, timeout=120), []

    def stream() -> None:
        body = {"model": BASE_MODEL, "prompt": "Count: one, two,", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {t.key}"}, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                started.wait()  # every stream is open and has its first chunk
                started.wait()  # the pool has been looked at
                rest = [line for line in lines if line]
        results.append((r.status_code, first, rest[-1]))

    threads = [threading.Thread(target=stream) for _ in range(num_streams)]
    for th in threads:
        th.start()
    started.wait()
    checked_out = gateway.db.pool.checkedout()
    started.wait()
    for th in threads:
        th.join(timeout=120)
    assert checked_out == 0
    assert len(results) == num_streams
    assert all(status == 200 and first.startswith("data: {") and last == "data: [DONE]"
               for status, first, last in results)


def test_requests_that_generate_hold_no_database_connection(make_tenant, gateway, server, engine_service):
    """A non-streamed request used to keep the connection its authentication took until it was answered:
    under 2x load, authentication of new requests waited 30 s for the pool (5 + 10) and failed with 500."""
    t = make_tenant()
    engine = engine_service.llm.engine
    results = []

    def call() -> None:
        body = {"model": BASE_MODEL, "prompt": "Count: one, two,", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {t.key}"}, timeout=120) as c:
            results.append(c.post("/v1/completions", json=body).status_code)

    gateway.usage.flush()  # the usage writer holds a connection while it stores earlier tests' records
    threads = [threading.Thread(target=call) for _ in range(12)]
    for th in threads:
        th.start()
    wait_until(lambda: len(engine.scheduler.running) >= 12, timeout=60, interval=0.005, what="12 running")
    checked_out = gateway.db.pool.checkedout()
    for th in threads:
        th.join(timeout=120)
    assert checked_out == 0 and results == [200] * 12


def test_max_tokens_defaults_to_16_as_openais_completions(make_tenant):
    """Legacy completions without max_tokens make 16 tokens (OpenAI's and vLLM's default there), not the
    chat default (LORAPLEX_DEFAULT_MAX_TOKENS, 256)."""
    t = make_tenant()
    body = {"model": BASE_MODEL, "prompt": "The capital of France is", "temperature": 0, "ignore_eos": True}
    r = t.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"
    chat = t.client.post("/v1/chat/completions", json={"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 0, "ignore_eos": True})
    assert chat.json()["usage"]["completion_tokens"] == 256
