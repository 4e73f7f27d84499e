"""Overload of the HTTP gateway: many clients past the engine's capacity, and what each one got back.

The load is chat completions (greedy, `ignore_eos`, `max_tokens` drawn uniformly from a range, so each
admitted request makes exactly that many tokens) sent with httpx from one asyncio loop:

- `closed_loop`: `num_clients` clients, each sending its next request when the last one is answered;
  after a 429 or 503 it waits the `retry-after` it was given (capped by `max_backoff_s`), as a client
  that honours it does.
- `open_loop`: Poisson arrivals at `rate` requests/s, whatever the answers (the harsher overload: the
  offered load does not fall when the server slows down).

Every answer is an `Outcome` (a transport error too, with status 0). `summarize` gives what
docs/reliability.md reports: sustained requests/s and output tokens/s (200s answered within the run's
`duration_s`, per second of it; requests still in flight then are awaited, and counted everywhere
else), the share shed (503),
the share refused by quotas (429), latency percentiles of the admitted requests, the slowest refusal,
and the answers that are neither 200 nor a designed refusal (the number that must be 0).
Times are `time.perf_counter()` seconds from the start of the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from loraplex.bench.metrics import percentile

PROMPTS = ("Tell me about the sea.", "Write a short poem about rain.", "Explain what a CPU does.",
           "List some fruits.", "Describe a busy market.", "What is a good breakfast?")
DESIGNED_503 = ("server_overloaded", "server_shutting_down")  # error codes of load shed by design


@dataclass
class Outcome:
    """One request's answer. request_id: the x-request-id header (usage records carry it)."""

    tenant: str
    start_s: float
    end_s: float
    status: int  # 0: no HTTP answer (connection refused or reset, timeout)
    max_tokens: int
    retry_after: str | None = None
    error_code: str | None = None
    error_type: str | None = None
    request_id: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    detail: str = ""

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_designed_refusal(self) -> bool:
        """A 429, or a 503 that sheds load by design, with the retry-after a client needs."""
        if self.retry_after is None:
            return False
        return self.status == 429 or (self.status == 503 and self.error_code in DESIGNED_503)


@dataclass
class LoadSpec:
    """What each request asks. Lengths in tokens."""

    model: str
    max_tokens: tuple[int, int] = (8, 300)
    timeout_s: float = 300.0
    max_backoff_s: float = 1.0
    seed: int = 0
    extra_body: dict = field(default_factory=dict)


async def _send(client: httpx.AsyncClient, tenant: str, key: str, spec: LoadSpec, rng: random.Random,
                t0: float) -> Outcome:
    max_tokens = rng.randint(*spec.max_tokens)
    body = {"model": spec.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **spec.extra_body}
    start = time.perf_counter() - t0
    try:
        r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError as exc:
        return Outcome(tenant, start, time.perf_counter() - t0, 0, max_tokens, detail=f"{type(exc).__name__}: {exc}")
    out = Outcome(tenant, start, time.perf_counter() - t0, r.status_code, max_tokens,
                  retry_after=r.headers.get("retry-after"), request_id=r.headers.get("x-request-id"))
    try:
        data = r.json()
    except ValueError:
        out.detail = r.text[:300]
        return out
    if r.status_code == 200:
        out.num_prompt_tokens = data["usage"]["prompt_tokens"]
        out.num_completion_tokens = data["usage"]["completion_tokens"]
    else:
        err = data.get("error") or {}
        out.error_code, out.error_type, out.detail = err.get("code"), err.get("type"), err.get("message", "")
    return out


def _client(url: str, num_connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s, trust_env=False)


async def closed_loop(url: str, keys: dict[str, str], spec: LoadSpec, *, num_clients: int,
                      duration_s: float, t0: float | None = None) -> list[Outcome]:
    """`num_clients` clients (spread over the tenants of `keys`: name -> API key) send until `duration_s`
    has passed since `t0` (a `time.perf_counter()` value, default now); requests in flight then are still
    awaited and kept. A client whose connection is refused stops (the server is gone)."""
    tenants = sorted(keys)
    outcomes: list[Outcome] = []
    t0 = time.perf_counter() if t0 is None else t0

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(spec.seed * 1_000_003 + i)
        tenant = tenants[i % len(tenants)]
        while time.perf_counter() - t0 < duration_s:
            out = await _send(client, tenant, keys[tenant], spec, rng, t0)
            outcomes.append(out)
            if out.status == 0 and "Connect" in out.detail:
                return
            if out.status in (429, 503):
                wait = float(out.retry_after) if out.retry_after and out.retry_after.isdigit() else 1.0
                await asyncio.sleep(min(wait, spec.max_backoff_s))

    async with _client(url, num_clients, spec.timeout_s) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(num_clients)))
    return outcomes


async def open_loop(url: str, keys: dict[str, str], spec: LoadSpec, *, rate: float,
                    duration_s: float) -> list[Outcome]:
    """Poisson arrivals at `rate` requests/s for `duration_s`, round-robin over the tenants; waits for
    every request sent."""
    tenants = sorted(keys)
    rng = random.Random(spec.seed)
    t0 = time.perf_counter()
    tasks = []
    async with _client(url, 4096, spec.timeout_s) as client:
        at, i = 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at >= duration_s:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tenant = tenants[i % len(tenants)]
            tasks.append(asyncio.create_task(_send(client, tenant, keys[tenant], spec, random.Random(rng.random()),
                                                   t0)))
            i += 1
        return list(await asyncio.gather(*tasks))


@dataclass
class OverloadSummary:
    """Requests/s are per second of `duration_s`; latencies in seconds."""

    duration_s: float
    num_requests: int
    statuses: dict[int, int]
    sustained_rps: float  # 200s answered within duration_s, per second
    output_tokens_per_s: float  # their completion tokens per second
    share_shed: float  # 503s / all answers
    share_rate_limited: float  # 429s / all answers
    p50_latency_s: float | None  # admitted (200) requests, from send to answer
    p99_latency_s: float | None
    max_refusal_latency_s: float | None
    num_undesigned: int  # neither 200 nor a designed refusal with retry-after: must be 0
    undesigned: list[str]


def summarize(outcomes: list[Outcome], duration_s: float) -> OverloadSummary:
    ok = [o for o in outcomes if o.status == 200]
    ok_in_time = [o for o in ok if o.end_s <= duration_s]
    refused = [o for o in outcomes if o.status in (429, 503)]
    bad = [o for o in outcomes if o.status != 200 and not o.is_designed_refusal]
    n = max(1, len(outcomes))
    latencies = [o.latency_s for o in ok]
    return OverloadSummary(
        duration_s=duration_s, num_requests=len(outcomes), statuses=dict(sorted(Counter(o.status for o in outcomes).items())),
        sustained_rps=len(ok_in_time) / duration_s,
        output_tokens_per_s=sum(o.num_completion_tokens for o in ok_in_time) / duration_s,
        share_shed=sum(o.status == 503 for o in outcomes) / n, share_rate_limited=sum(o.status == 429 for o in outcomes) / n,
        p50_latency_s=percentile(latencies, 50), p99_latency_s=percentile(latencies, 99),
        max_refusal_latency_s=max((o.latency_s for o in refused), default=None), num_undesigned=len(bad),
        undesigned=[f"{o.status} {o.error_code}: {o.detail[:120]}" for o in bad[:10]])
