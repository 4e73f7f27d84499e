"""POST /v1/completions: text prompts, token-id prompts, several prompts, streaming."""

from __future__ import annotations

import json

import pytest

from tests.helpers import chat_ids
from tests.platform.factories import BASE_MODEL

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
                                         ({"prompt": [10**9]}, "prompt"), ({"prompt": "x", "echo": True}, None)])
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
