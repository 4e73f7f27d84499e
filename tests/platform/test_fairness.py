"""Fair share over real HTTP: one tenant's burst of streams does not hold back another tenant's requests.

Counted in engine steps (`/admin/engine`'s num_steps), not seconds, so the check does not depend on the
machine's speed: under "fcfs" the quiet tenant would wait for the burst's rows to free, about max_tokens
steps."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow

NOISY_MAX_TOKENS = 150


def first_content(lines) -> str | None:
    """Read an SSE chat stream's lines up to its first non-empty content delta."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                return chunk["choices"][0]["delta"]["content"]
    return None


def test_a_quiet_tenant_is_served_within_a_few_steps_of_a_noisy_tenants_burst(make_tenant, admin, gateway):
    engine = gateway.engine.llm.engine
    assert engine.config.scheduling_policy == "fair"
    max_num_seqs = engine.config.max_num_seqs  # 16, and KV room for fewer of these: both limits are hit
    noisy, quiet = make_tenant(), make_tenant()
    started, stop = threading.Semaphore(0), threading.Event()
    failures: list[str] = []

    def stream_forever(i: int) -> None:
        body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": f"Count to a thousand, #{i}"}],
                "max_tokens": NOISY_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with noisy.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.read()!r}")
                    return
                for _ in r.iter_lines():
                    if stop.is_set():
                        return  # closing the stream aborts the request
        finally:
            started.release()

    threads = [threading.Thread(target=stream_forever, args=(i,), daemon=True) for i in range(max_num_seqs + 8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while admin.get("/admin/engine").json()["num_waiting"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the burst fills the batch and queues behind it
        assert admin.get("/admin/engine").json()["num_running"] >= max_num_seqs // 2 and not failures
        waits = []
        for i in range(3):
            steps_before = admin.get("/admin/engine").json()["num_steps"]
            body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": f"Say hi {i}"}], "max_tokens": 3,
                    "temperature": 0, "stream": True}
            with quiet.client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert first_content(lines)
                waits.append(admin.get("/admin/engine").json()["num_steps"] - steps_before)
                for _ in lines:
                    pass
            state = admin.get("/admin/engine").json()
            busy = next(t for t in state["tenants"] if t["tenant_id"] == noisy.id)
            assert busy["num_running"] + busy["num_waiting"] == len(threads)  # the burst was still there
        # a step to queue the request, one to admit it (preempting the noisy tenant's newest request) and
        # run its prefill, a few more for the HTTP round trips of the two reads around it
        assert max(waits) <= 6, waits
        assert waits and all(w < NOISY_MAX_TOKENS // 4 for w in waits)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures
