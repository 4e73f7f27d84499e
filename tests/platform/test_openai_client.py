"""The official `openai` Python client, unchanged, against the gateway (only base_url and api_key set;
max_retries=0 so that a 429 shows at once instead of being retried)."""

from __future__ import annotations

import openai
import pytest

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow


@pytest.fixture
def make_client(server):
    def make(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

    return make


def test_chat_completions_models_and_streaming(make_tenant, make_client, peft_adapters):
    t = make_tenant()
    assert t.upload("mine", peft_adapters[0]).status_code == 201
    client = make_client(t.key)
    assert [m.id for m in client.models.list()] == [BASE_MODEL, "mine"]
    assert client.models.retrieve("mine").owned_by == t.name

    chat = client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 5 and chat.model == "mine"

    stream = client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    done = client.completions.create(model=BASE_MODEL, prompt="One, two,", max_tokens=3, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 3
    pieces = client.completions.create(model=BASE_MODEL, prompt="One, two,", max_tokens=3, temperature=0,
                                       stream=True)
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text

    chat_cc = client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_completion_tokens=2, temperature=0)
    assert chat_cc.usage.completion_tokens <= 2


def test_a_response_says_where_its_adapter_was(make_tenant, make_client, peft_adapters):
    """x-loraplex-adapter-tier: "disk" for the first call after an upload (a cold load from the store),
    "slots" for the next one (still in its adapter slot); a base-model call has no such header."""
    t = make_tenant()
    assert t.upload("tiered", peft_adapters[1]).status_code == 201
    client = make_client(t.key)
    messages = [{"role": "user", "content": "Say hi"}]
    tiers = [client.chat.completions.with_raw_response.create(model="tiered", messages=messages, max_tokens=2)
             .headers.get("x-loraplex-adapter-tier") for _ in range(2)]
    assert tiers == ["disk", "slots"]
    base = client.chat.completions.with_raw_response.create(model=BASE_MODEL, messages=messages, max_tokens=2)
    assert "x-loraplex-adapter-tier" not in base.headers and "x-loraplex-replica" not in base.headers


def test_errors_map_to_the_clients_exceptions(make_tenant, make_client, peft_adapters):
    owner, other = make_tenant(), make_tenant(rpm=1)
    assert owner.upload("secret", peft_adapters[0]).status_code == 201
    with pytest.raises(openai.AuthenticationError) as e:
        make_client("lpx-not-a-key").models.list()
    assert e.value.code == "invalid_api_key"
    client = make_client(other.key)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="secret", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.code == "rate_limit_exceeded" and e.value.type == "requests"
    assert int(e.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.BadRequestError) as e:
        make_client(owner.key).chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "x"}],
                                                       temperature=5)
    assert e.value.param == "temperature"
