"""Scale-out on a real local Ray instance: 2 gateway ingresses and 2 engine replicas of the default model
behind Serve's HTTP proxy, Redis quotas, one SQLite file, one adapter store (`platform/scaleout`).

The cluster starts once for the module (about 30 s on 2 cores: Ray, then two engines loading); the
fault tests run last: a hung replica, a dead ingress, then killed replicas.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the scale-out tests need the ray extra: pip install -e '.[test,ray]'")

from loraplex.platform.scaleout import app as scaleout  # noqa: E402
from tests.platform import factories  # noqa: E402
from tests.platform.servers import free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.slow
SLACK = 2  # affinity slack of this cluster: small, so that a burst spills to the second replica
ACCEPT_S, STALL_S = 3.0, 6.0  # the ingresses' replica timeouts here (heartbeats and caller checks: 1.5 s)


@pytest.fixture(scope="module")
def cluster(make_settings, redis_db, tmp_path_factory, model_path):
    from ray import serve

    settings = make_settings(redis_url=redis_db(), port=free_port(), dtype="float32",
                             kv_cache_memory=32 << 20, max_num_seqs=8, max_loras=2, max_num_waiting_seqs=64,
                             max_queue_wait_s=None, affinity_slack=SLACK, replica_accept_timeout_s=ACCEPT_S,
                             replica_stall_timeout_s=STALL_S)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        scaleout.start(settings, num_replicas=2, num_ingresses=2)
        base = f"http://127.0.0.1:{settings.port}"
        admin = factories.client(base, settings.admin_key.get_secret_value())
        adapters = factories.make_peft_adapters(model_path, tmp_path_factory.mktemp("scaleout"), [101, 102, 103, 104])
        yield {"settings": settings, "base": base, "admin": admin, "adapters": adapters}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def tenant(cluster):
    t = factories.make_tenant(cluster["admin"], cluster["base"])
    for name, path in zip("abcd", cluster["adapters"], strict=True):
        r = t.upload(name, path)
        assert r.status_code == 201, r.text
    return t


def replica_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-loraplex-replica"]


def health_status(base: str) -> int | None:
    """GET /health's status, or None while the proxy has no ingress to answer it."""
    try:
        return httpx.get(base + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def named_actors(deployment: str) -> list[str]:
    """Names of the live actors of `deployment`'s replicas."""
    prefix = f"SERVE_REPLICA::{scaleout.APP_NAME}#{deployment}#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def engine_actor(replica: str):
    return ray.get_actor(f"SERVE_REPLICA::{scaleout.APP_NAME}#{scaleout.ENGINE_DEPLOYMENT}#{replica}",
                         namespace="serve")


def unfinished_by_replica() -> dict[str, int]:
    """Running + waiting requests of the engine replicas that answered, read through a handle of the
    test's own: asked until both answered or 16 times (its calls go to the less busy replica, so a busy
    one answers only once the other is as busy)."""
    from ray import serve

    handle = serve.get_deployment_handle(scaleout.ENGINE_DEPLOYMENT, scaleout.APP_NAME)
    seen: dict[str, int] = {}
    for _ in range(16):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats["num_running"] + stats["num_waiting"]
        if len(seen) == 2:
            break
    return seen


def test_openai_client_unchanged_and_tokens_match_one_process(cluster, tenant, server, admin):
    """chat, completions, streaming and models through Ray Serve answer exactly what one process does."""
    import openai

    ray_client = openai.OpenAI(base_url=cluster["base"] + "/v1", api_key=tenant.key, max_retries=0)
    one = factories.make_tenant(admin, server.url)
    local_client = openai.OpenAI(base_url=server.url + "/v1", api_key=one.key, max_retries=0)
    assert httpx.get(cluster["base"] + "/health").json() == {"status": "ok"}
    assert factories.BASE_MODEL in {m.id for m in ray_client.models.list().data}
    assert set("abcd") <= {m.id for m in ray_client.models.list().data}

    messages = [{"role": "user", "content": "Name three colours."}]
    raw = ray_client.chat.completions.with_raw_response.create(model=factories.BASE_MODEL, messages=messages,
                                                              max_tokens=12, temperature=0)
    assert raw.headers["x-loraplex-replica"]
    chat = raw.parse()
    expected = local_client.chat.completions.create(model=factories.BASE_MODEL, messages=messages, max_tokens=12,
                                                    temperature=0)
    assert chat.choices[0].message.content == expected.choices[0].message.content
    assert chat.usage.completion_tokens == expected.usage.completion_tokens == 12

    chunks = list(ray_client.chat.completions.create(model=factories.BASE_MODEL, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    text = ray_client.completions.create(model=factories.BASE_MODEL, prompt="The capital of France is",
                                         max_tokens=6, temperature=0, n=2)
    expected_text = local_client.completions.create(model=factories.BASE_MODEL, prompt="The capital of France is",
                                                    max_tokens=6, temperature=0, n=2)
    assert [c.text for c in text.choices] == [c.text for c in expected_text.choices]

    # echo's prompt log-probabilities cross from replica to ingress, streamed and not
    scored = dict(model=factories.BASE_MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                  echo=True, logprobs=2)
    echoed = ray_client.completions.create(**scored).choices[0]
    expected_echo = local_client.completions.create(**scored).choices[0]
    assert echoed.text == expected_echo.text and echoed.logprobs.tokens == expected_echo.logprobs.tokens
    assert echoed.logprobs.token_logprobs[0] is None
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx(expected_echo.logprobs.token_logprobs[1:], abs=1e-4)
    streamed = [ch.logprobs for c in ray_client.completions.create(**scored, stream=True) for ch in c.choices
                if ch.logprobs]
    assert [t for lp in streamed for t in lp.tokens] == echoed.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == echoed.logprobs.token_logprobs
    with pytest.raises(openai.NotFoundError):
        ray_client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)


def test_one_adapter_stays_on_one_replica_while_others_spread(tenant):
    """20 calls for adapter a all land on the replica that first loaded it; b and c, cold, each keep to one
    replica, and together with a they use both."""
    model = "a"
    r = tenant.chat(model=model)
    first = replica_of(r)
    assert r.headers["x-loraplex-adapter-tier"] == "disk"  # its first call anywhere: a cold load
    with ThreadPoolExecutor(2) as pool:  # 2 at a time: within the slack on either ingress's view
        replicas = list(pool.map(lambda _: replica_of(tenant.chat(model=model, max_tokens=8)), range(20)))
    assert set(replicas) == {first}
    assert tenant.chat(model=model).headers["x-loraplex-adapter-tier"] == "slots"  # resident where it went
    used = {first}
    for name in "bc":
        served = {replica_of(tenant.chat(model=name)) for _ in range(5)}
        assert len(served) == 1, (name, served)
        used |= served
    assert len(used) == 2


def test_a_burst_spills_past_the_slack_and_uploads_serve_on_both_replicas(tenant):
    """An adapter uploaded once through either ingress is servable on every replica: a burst much larger
    than the slack overflows its replica onto the other, which loads it from the shared store."""
    model = "d"
    first = replica_of(tenant.chat(model=model))
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: tenant.chat(model=model, max_tokens=48, ignore_eos=True), range(16)))
    served = [replica_of(r) for r in responses]
    assert len(set(served)) == 2 and first in served
    contents = {r.json()["choices"][0]["message"]["content"] for r in responses}
    assert len(contents) == 1  # the same greedy answer from either replica


def test_rpm_is_exact_across_ingresses(cluster):
    t = factories.make_tenant(cluster["admin"], cluster["base"], rpm=5)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: t.chat(max_tokens=1), range(9)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 5 + [429] * 4
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_client_that_disconnects_aborts_its_request_on_the_replica(cluster, tenant):

    model = "b"
    body = {"model": model, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with tenant.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers["x-loraplex-replica"]
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: unfinished_by_replica().get(replica) == 0, timeout=20,
               what="the replica to abort the stream's request")


def test_a_hung_replica_ends_its_calls_with_503_and_new_calls_go_elsewhere(tenant):
    """A replica that stops (SIGSTOP) sends nothing, not even its heartbeat: its calls end with 503
    replica_unavailable after STALL_S, a new call for its adapter is taken by the other replica after at
    most ACCEPT_S, and once it runs again it aborts the calls the ingress gave up on."""
    model = "a"
    victim = replica_of(tenant.chat(model=model, max_tokens=2))
    pid = ray._private.state.actors(engine_actor(victim)._actor_id.hex())["Pid"]
    def timed_chat():
        r = tenant.chat(model=model, max_tokens=300, ignore_eos=True)
        return r, time.monotonic()

    with ThreadPoolExecutor(2) as pool:
        inflight = [pool.submit(timed_chat) for _ in range(2)]
        # decoding on the victim (a fixed 2 s was too short on a loaded machine: the calls had not reached it,
        # so they went to the other replica after ACCEPT_S and none was lost)
        wait_until(lambda: unfinished_by_replica().get(victim, 0) >= 1, timeout=60, interval=0.1,
                   what="the calls to run on the victim")
        time.sleep(0.5)  # its "received" items reach the ingress
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            results = [f.result() for f in inflight]
            responses = [r for r, _ in results]
            t = time.monotonic()
            after = tenant.chat(model=model, max_tokens=2)
            after_s = time.monotonic() - t
        finally:
            os.kill(pid, signal.SIGCONT)
    lost = [(r, t) for r, t in results if r.status_code != 200]  # one that spilled to the other replica ends well
    assert lost and all(r.headers["x-loraplex-replica"] != victim for r in responses if r.status_code == 200)
    for r, ended in lost:
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable", r.text
        assert int(r.headers["retry-after"]) >= 1
        assert STALL_S - 1 <= ended - stopped < STALL_S + 10, ended - stopped
    assert replica_of(after) != victim and after_s < ACCEPT_S + 10, after_s
    wait_until(lambda: unfinished_by_replica().get(victim) == 0, timeout=30,
               what="the resumed replica to abort the calls given up on")


def test_an_ingress_that_dies_has_its_calls_aborted_on_the_replicas(cluster, tenant):
    """Ray does not cancel a replica's calls when their ingress dies; the replica finds it gone at its next
    check of the caller (every STALL_S / 4 here) and aborts them, so nothing decodes for nobody. Serve
    starts new ingresses, which answer as before."""
    engines = [engine_actor(name.rsplit("#", 1)[1]) for name in named_actors(scaleout.ENGINE_DEPLOYMENT)]

    def ongoing() -> int:  # calls running on the engine replicas, as Serve counts them on each (no routing)
        return sum(ray.get([a.get_num_ongoing_requests.remote() for a in engines]))

    body = {"model": "b", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 600,
            "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=cluster["base"], headers={"Authorization": f"Bearer {tenant.key}"},
                            timeout=60) for _ in range(2)]
    streams = [c.stream("POST", "/v1/chat/completions", json=body) for c in clients]
    readers = []  # kept: a line iterator collected early would close its stream (a client that left)
    try:
        for s in streams:
            r = s.__enter__()
            assert r.status_code == 200, r.read()
            readers.append(r.iter_lines())
            for _ in range(3):
                next(readers[-1])
        assert ongoing() == 2
        ingresses = named_actors(scaleout.INGRESS_DEPLOYMENT)
        assert len(ingresses) == 2, ingresses
        killed = time.monotonic()
        for name in ingresses:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        # 600 tokens take these replicas over 10 s; the check finds the dead ingress within 1.5-3 s
        wait_until(lambda: ongoing() == 0, timeout=8, what="the replicas to abort the dead ingresses' calls")
        assert time.monotonic() - killed < 8
    finally:
        for s in streams:
            try:
                s.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        for c in clients:
            c.close()
    wait_until(lambda: health_status(cluster["base"]) == 200, timeout=60, what="Serve's new ingresses")
    assert replica_of(tenant.chat(model="b", max_tokens=2))


def test_a_killed_replica_ends_its_calls_with_503_and_is_replaced(cluster, tenant):
    """Calls in flight on a replica that dies answer 503 replica_unavailable with retry-after; calls after
    succeed on a live replica; usage has one record per call, ok for each 200. With the other replica
    killed too, /health answers 503 and a call 503 replica_unavailable after one accept timeout (none
    hangs) until Serve's new replicas run."""
    from ray import serve
    from sqlalchemy import create_engine, text

    model = "c"
    victim = replica_of(tenant.chat(model=model))
    db = create_engine(cluster["settings"].sqlalchemy_url)

    def records() -> list[tuple[int, str, int]]:
        with db.connect() as c:
            return [tuple(row) for row in c.execute(text(
                "SELECT id, status, num_completion_tokens FROM usage_records WHERE tenant_id = :t"), {"t": tenant.id})]

    wait_until(lambda: len(records()) >= 1, timeout=10, what="usage of the earlier calls")
    time.sleep(1.5)  # the usage writer's batch of earlier calls is in
    before = {r[0] for r in records()}
    with ThreadPoolExecutor(4) as pool:
        inflight = [pool.submit(tenant.chat, model=model, max_tokens=400, ignore_eos=True) for _ in range(4)]
        wait_until(lambda: unfinished_by_replica().get(victim, 0) >= 1, timeout=60, interval=0.1,
                   what="the calls to run on the victim")
        time.sleep(0.5)  # its "received" items reach the ingress
        actor = ray.get_actor(f"SERVE_REPLICA::{scaleout.APP_NAME}#{scaleout.ENGINE_DEPLOYMENT}#{victim}",
                              namespace="serve")
        ray.kill(actor, no_restart=True)
        responses = [f.result() for f in inflight]
    lost = [r for r in responses if r.status_code == 503]
    assert lost, [r.status_code for r in responses]
    for r in lost:
        assert r.json()["error"]["code"] == "replica_unavailable", r.text
        assert int(r.headers["retry-after"]) >= 1
    after = [tenant.chat(model=model) for _ in range(3)]
    assert all(r.status_code == 200 for r in after), [r.text for r in after]
    assert all(r.headers["x-loraplex-replica"] != victim for r in after)

    # the survivor too, and the victim's successor if it is loading already: no engine replica runs
    for name in named_actors(scaleout.ENGINE_DEPLOYMENT):
        try:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        except ValueError:  # gone meanwhile
            pass

    def running_replicas() -> int:
        status = serve.status().applications[scaleout.APP_NAME].deployments[scaleout.ENGINE_DEPLOYMENT]
        return status.replica_states.get("RUNNING", 0)

    # Serve's controller sees them gone within a second or two; a successor takes 10-25 s to load here
    wait_until(lambda: running_replicas() == 0, timeout=10, interval=0.2, what="Serve to see both replicas gone")
    # each ingress asks Serve every 2 s (client.STATUS_S), and the proxy sends /health to either
    wait_until(lambda: health_status(cluster["base"]) == 503, timeout=8, interval=0.2, what="/health to answer 503")
    time.sleep(2.5)  # the other ingress has asked too
    health = httpx.get(cluster["base"] + "/health", timeout=10)
    assert health.status_code == 503 and health.json() == {"status": "unavailable",
                                                           "detail": "no engine replica is running"}, health.text
    t = time.monotonic()
    r = tenant.chat(model=model, max_tokens=2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable", r.text
    assert time.monotonic() - t < ACCEPT_S + 5  # one try: the ingress sees that no replica runs
    wait_until(lambda: running_replicas() == 2, timeout=180, interval=1, what="Ray to replace the killed replicas")
    wait_until(lambda: health_status(cluster["base"]) == 200, timeout=10, what="/health to answer ok again")

    calls = responses + after
    wait_until(lambda: len({r[0] for r in records()} - before) == len(calls), timeout=10,
               what="one usage record per call")
    new = [r for r in records() if r[0] not in before]
    ok_tokens = sorted(r.json()["usage"]["completion_tokens"] for r in calls if r.status_code == 200)
    assert sorted(n for _, status, n in new if status == "ok") == ok_tokens
    assert sorted(status for _, status, _ in new if status != "ok") == ["error"] * len(lost)
    db.dispose()
