"""`loraplex serve` as real processes: one command starts the gateway (migrations, admin key printed
once), and two processes sharing one Redis admit exactly a tenant's limit between them. Also the
README's adapter script, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.platform import factories
from tests.platform.servers import REPO, ServeProcess

pytestmark = pytest.mark.slow

LEASE_S = 3.0  # the processes' concurrency lease: a killed one's slots are free within it


@pytest.fixture
def two_processes(tmp_path, redis_db, model_path):
    env = {"LORAPLEX_HOME": str(tmp_path / "home"), "LORAPLEX_MODEL": str(model_path), "LORAPLEX_DTYPE": "float32",
           "LORAPLEX_KV_CACHE_MEMORY": str(64 << 20), "LORAPLEX_REDIS_URL": redis_db(),
           "LORAPLEX_ENVIRONMENT": "production", "LORAPLEX_CONCURRENCY_LEASE_S": str(LEASE_S)}
    procs = []
    try:
        procs.append(ServeProcess(env, tmp_path / "a.log").wait_ready())  # migrations run here, not in parallel
        procs.append(ServeProcess(env, tmp_path / "b.log").wait_ready())
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_two_processes_share_one_limit(two_processes, tmp_path, model_path):
    a, b = two_processes
    keys = re.findall(r"lpx-[A-Za-z0-9_-]{43}", a.output())
    assert len(keys) == 1, a.output()  # printed once, by the first start only
    assert "lpx-" not in b.output()
    with factories.client(a.url, keys[0]) as admin:
        tenant = factories.make_tenant(admin, a.url, rpm=5)
    clients = [factories.client(a.url, tenant.key), factories.client(b.url, tenant.key)]
    body = {"model": factories.BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def call(i):
        return clients[i % 2].post("/v1/chat/completions", json=body)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(call, range(12)))
    assert Counter(r.status_code for r in responses) == {200: 5, 429: 7}
    for r in responses:
        if r.status_code == 429:
            assert r.headers["x-ratelimit-limit-requests"] == "5" and int(r.headers["retry-after"]) >= 1

    # the README walk-through's adapter script makes an adapter the gateway takes
    out = tmp_path / "readme-adapter"
    home = model_path.parents[1]  # $LORAPLEX_HOME of the model cache
    subprocess.run([sys.executable, str(REPO / "examples" / "make_adapter.py"), str(out), "--steps", "0"],
                   check=True, cwd=REPO, env={**os.environ, "LORAPLEX_HOME": str(home)},
                   capture_output=True, timeout=600)
    with factories.client(a.url, keys[0]) as admin:
        owner = factories.make_tenant(admin, a.url)
    assert owner.upload("readme", out).status_code == 201
    owner_b = factories.TenantClient(owner.id, owner.name, owner.key, factories.client(b.url, owner.key))
    r = owner_b.chat("readme", max_tokens=3)  # uploaded through one process, served by the other
    assert r.status_code == 200 and r.json()["model"] == "readme"
    for c in clients + [owner.client, owner_b.client]:
        c.close()


def test_a_killed_process_frees_its_tenants_slot_within_the_lease(two_processes):
    """SIGKILL one process in the middle of a tenant's stream (no settle, no shutdown): the other refuses
    the tenant at its max_concurrent_requests while the stream's slot is renewed, then admits it once the
    lease runs out (the lease was a fixed 10 minutes before c72eb6f)."""
    a, b = two_processes
    admin_key = re.findall(r"lpx-[A-Za-z0-9_-]{43}", a.output())[0]
    with factories.client(a.url, admin_key) as admin:
        tenant = factories.make_tenant(admin, a.url, max_concurrent_requests=1)
    on_a, on_b = factories.client(a.url, tenant.key), factories.client(b.url, tenant.key)
    body = {"model": factories.BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    long = {**body, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with on_b.stream("POST", "/v1/chat/completions", json=long) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()  # kept: a line generator dropped here would close the stream (a client gone)
        next(line for line in lines if line.startswith("data: "))  # generating on b
        time.sleep(2 * LEASE_S)  # b renews the slot
        refused = on_a.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["message"].startswith("Too many concurrent requests: Limit 1.")
        b.proc.kill()
        b.proc.wait()
    killed = time.monotonic()
    while (r := on_a.post("/v1/chat/completions", json=body)).status_code == 429:
        assert time.monotonic() - killed < LEASE_S + 5, "the killed process's slot was never freed"
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    on_a.close()
    on_b.close()
    tenant.client.close()


def test_a_server_not_up_in_time_is_stopped_and_its_log_shown(tmp_path, model_path):
    """A start that outlasts wait_ready's timeout (a kernel build on a slow CPU, say) must not leave the
    server running after the test, as it did once."""
    proc = ServeProcess({"LORAPLEX_HOME": str(tmp_path / "home"), "LORAPLEX_MODEL": str(model_path)},
                        tmp_path / "slow.log")
    with pytest.raises(TimeoutError, match=r"timed out after 0.5 s waiting for loraplex serve; its log:"):
        proc.wait_ready(timeout=0.5)
    assert proc.proc.poll() is not None  # stopped, not left running
