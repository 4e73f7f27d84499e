"""One tenant's request that makes the engine fault ends alone, over real HTTP: that tenant gets a 503
`engine_error` with retry-after (and can send again), another tenant's requests running in the same
batch get exactly the answers they get without it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from loraplex.platform.models import UsageRecord
from tests.platform.servers import wait_until

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a fruit.", "Say hi.", "Count to five.", "What is water made of?", "Tell me a color.",
             "Why is the sky blue?", "Name a planet.", "What is the capital of France?"]


def eight_requests(tenant) -> list[dict]:
    """Tenant b's 8 chats: greedy and seeded sampling, 24 tokens each (ignore_eos: they run together)."""
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda i: tenant.chat(content=QUESTIONS[i], max_tokens=24, ignore_eos=True,
                                                 temperature=0 if i % 2 else 0.8, seed=i), range(8)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json() for r in rs]


def test_a_poisoned_request_ends_alone(make_tenant, engine_service, gateway):
    a, b = make_tenant(), make_tenant()
    clean = eight_requests(b)
    engine = engine_service.llm.engine
    raised = threading.Event()
    batch_sizes = []  # requests running when a's sampling failed: b's 8 and a's

    def poison(stage, req):  # tenant a's sampling fails, as a bad sampling value once did
        if stage == "sample" and req is not None and req.tenant_id == a.id:
            batch_sizes.append(len(engine.scheduler.running))
            raised.set()
            raise OverflowError("injected: Overflow when unpacking long long")

    results = {}

    def poisoned_call():
        wait_until(lambda: len(engine.scheduler.running) >= 8, timeout=60, interval=0.005,
                   what="b's requests running")
        results["a"] = a.chat(content="Tell me a story.", max_tokens=24)

    engine.inject_fault = poison
    try:
        thread = threading.Thread(target=poisoned_call)
        thread.start()
        mixed = eight_requests(b)
        thread.join(timeout=120)
    finally:
        engine.inject_fault = None
    assert raised.is_set() and set(batch_sizes) == {9}  # in the batch with b's 8 (the batch try, then its row)
    r = results["a"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": "The engine failed while generating this request; try again.",
                                 "type": "server_error", "param": None, "code": "engine_error"}
    for before, after in zip(clean, mixed, strict=True):
        assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
        details = after["usage"].pop("prompt_tokens_details"), before["usage"].pop("prompt_tokens_details")
        assert after["usage"] == before["usage"]
        assert details[0]["cached_tokens"] >= details[1]["cached_tokens"]  # the same prompts, cached since
    assert a.chat(content="Tell me a story.", max_tokens=4).status_code == 200  # a's next request is served

    def records(tenant_id):
        with gateway.sessions() as s:
            return list(s.scalars(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)))

    wait_until(lambda: len(records(a.id)) == 2 and len(records(b.id)) == 16, timeout=20, what="usage")
    assert sorted(r.status for r in records(a.id)) == ["error", "ok"]
    assert {r.status for r in records(b.id)} == {"ok"}


def test_an_adapter_whose_store_files_broke_since_upload_costs_nothing(make_tenant, gateway, tmp_path):
    """Store files are checked at upload and registered without a second parse; one damaged since then
    fails at its first load, on the load thread: the call answers 503 `adapter_load_failed` with the
    reason, its quota reservation and RPM unit are refunded, and the base model serves on."""
    from loraplex.adapters.synthetic import write_random_adapter
    from loraplex.platform import crud
    from loraplex.platform.adapter_names import store_name, store_owner

    t = make_tenant(rpm=2)
    write_random_adapter(tmp_path / "fresh", gateway.engine.model_config, r=8, alpha=8, seed=4242)  # its own digest
    assert t.upload("fresh", tmp_path / "fresh").status_code == 201
    with gateway.sessions() as s:
        row = crud.get_adapter(s, t.id, "fresh")
    tensors = gateway.store.path(store_owner(t.id), store_name(row.name, row.digest)) / "adapter_model.safetensors"
    tensors.chmod(0o644)
    tensors.write_bytes(b"not a safetensors file")
    for _ in range(3):  # rpm 2: the refunds keep the tenant under it
        r = t.chat(model="fresh")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "adapter_load_failed" and err["message"].startswith("The adapter `fresh` could not be loaded: ")
    # the three refused calls cost no RPM unit: the tenant's 2 a minute are still there for the base model
    assert [t.chat().status_code for _ in range(3)] == [200, 200, 429]
