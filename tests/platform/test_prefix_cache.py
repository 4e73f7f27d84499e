"""Prefix caching through the API with the official `openai` client: `usage.prompt_tokens_details.cached_tokens`
for a shared system prompt (chat, completions, streamed usage), quotas and usage still counting the whole
prompt, and no sharing across tenants or across an adapter's versions."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest
from sqlalchemy import select

from loraplex.platform.models import UsageRecord
from tests.platform.factories import BASE_MODEL
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


def system_prompt() -> str:
    """About 700 tokens of a company's rules, unique to the test run so nothing else has cached them."""
    rules = [f"Rule {i}: when a customer asks about order {1000 + 7 * i}, check the warehouse record, confirm "
             f"the delivery window, and never promise a refund before a supervisor approves it." for i in range(20)]
    return f"Session {uuid.uuid4().hex}. You are the support assistant of Northwind Traders. " + " ".join(rules)


def chat(client: openai.OpenAI, model: str, system: str, question: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "system", "content": system},
                                                                 {"role": "user", "content": question}],
                                          max_tokens=4, temperature=0, **kw)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.fixture
def make_client(server):
    return lambda key: openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_a_shared_system_prompt_is_computed_once_and_still_counted_whole(make_tenant, make_client, server, gateway):
    t = make_tenant()
    client = make_client(t.key)
    system = system_prompt()
    before = httpx.get(server.url + "/metrics").text
    questions = ["Where is my order?", "Can I change the address?", "Is there a refund?", "Who approves it?"]
    answers = [chat(client, BASE_MODEL, system, q) for q in questions]
    n = answers[0].usage.prompt_tokens
    assert n >= 700
    assert cached(answers[0].usage) == 0  # nothing sent before
    for a in answers[1:]:  # every full block of the system prompt and the chat template's start
        assert 600 <= cached(a.usage) < a.usage.prompt_tokens and cached(a.usage) % BLOCK_SIZE == 0
    # the same prompt again: cached whole but its last block (the last position's logits are needed)
    again = chat(client, BASE_MODEL, system, questions[0])
    assert cached(again.usage) == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.choices[0].message.content == answers[0].choices[0].message.content

    stream = chat(client, BASE_MODEL, system, "And a last one?", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert cached(chunks[-1].usage) >= 600 and not chunks[-1].choices

    first = client.completions.create(model=BASE_MODEL, prompt=system, max_tokens=2, temperature=0)
    second = client.completions.create(model=BASE_MODEL, prompt=system + " Answer:", max_tokens=2, temperature=0)
    assert cached(first.usage) == 0 and cached(second.usage) >= 600

    # the usage records (what quotas settle on) count every prompt token, cached or not
    calls = [*answers, again, first, second]
    prompt_total = sum(c.usage.prompt_tokens for c in calls) + chunks[-1].usage.prompt_tokens

    def records():
        with gateway.sessions() as s:
            return list(s.scalars(select(UsageRecord).where(UsageRecord.tenant_id == t.id)))

    wait_until(lambda: len(records()) == 8, timeout=20, what="usage records")
    assert sum(r.num_prompt_tokens for r in records()) == prompt_total

    after = httpx.get(server.url + "/metrics").text
    hits = metric(after, "loraplex_prefix_cache_hits_total") - metric(before, "loraplex_prefix_cache_hits_total")
    assert hits >= sum(cached(c.usage) for c in calls) + cached(chunks[-1].usage)
    admin = httpx.get(server.url + "/admin/engine",
                      headers={"Authorization": f"Bearer {server.settings.admin_key.get_secret_value()}"}).json()
    assert admin["prefix_cache"]["enabled"] is True and admin["prefix_cache"]["num_hit_tokens"] >= hits


def test_tenants_and_adapter_versions_never_share_blocks(make_tenant, make_client, peft_adapters):
    a, b = make_tenant(), make_tenant()
    assert a.upload("helper", peft_adapters[0]).status_code == 201
    assert b.upload("helper", peft_adapters[1]).status_code == 201  # same name, other weights, other tenant
    ca, cb = make_client(a.key), make_client(b.key)
    system = system_prompt()
    assert cached(chat(ca, "helper", system, "Hello?").usage) == 0
    assert cached(chat(ca, "helper", system, "Hello again?").usage) >= 600
    assert cached(chat(ca, BASE_MODEL, system, "Hello?").usage) == 0  # the base model: other K/V
    assert cached(chat(cb, "helper", system, "Hello?").usage) == 0  # b's adapter, b's cache
    assert cached(chat(cb, BASE_MODEL, system, "Hello?").usage) == 0  # a's base-model blocks are a's alone
    # a deletes its adapter and uploads new weights under the same name: the old blocks are never met
    assert a.client.delete("/v1/adapters/helper").status_code == 200
    assert a.upload("helper", peft_adapters[1]).status_code == 201
    fresh = chat(ca, "helper", system, "Hello again?")
    assert cached(fresh.usage) == 0
    assert cached(chat(ca, "helper", system, "Hello again?").usage) >= 600
