"""`loraplex bench --preset scale-out`: the Zipf multi-adapter workload through `loraplex serve --replicas`
on a local Ray instance, on 1 and 2 engine replicas, with our adapter-affinity router and with Ray
Serve's default one (`platform/scaleout`, docs/scale-out.md).

One tenant owns `num_adapters` random rank-8 adapters (q/k/v/o) and sends `num_requests` completions,
each drawn Zipf(`alpha`) over the adapters (p(i) ~ 1 / i**alpha, the S-LoRA setting), random prompt
token ids of `prompt_len` tokens, `max_tokens` greedy tokens with `ignore_eos`. `concurrency` clients
send them in order, each its next request when its last one ended (a closed loop: the same load on
every configuration, whatever its speed). Every configuration is a fresh Ray instance, database and
Redis database, with the same draws.

What a request reports (its response headers): `x-loraplex-replica`, the replica that ran it, and
`x-loraplex-adapter-tier`, where its adapter was on that replica when it arrived (`AdapterManager.tier`,
read on the engine thread as the call is queued). Measured per configuration:
- slot hit rate: requests whose adapter was in an adapter slot ("slots");
- host hits: in the replica's host memory ("cpu"), a slot load that is a copy;
- cold loads: requests that found it only in the shared store ("disk" or "failed"), each a read of its
  files; "loading" (read in progress for an earlier request) is neither;
- output tokens/s over the run (first send to last byte), TTFT p50/p99 (call to first text chunk).

Each replica is sized so that its adapters do not all fit: `max_loras` slots of rank `max_lora_rank`
and `max_cpu_loras` adapters in host memory. On one machine the replicas share its cores (each gets
`num_cpus / replicas` threads), so throughput across replica counts is not a scale-out figure; the
routing's effect is in the hit rate and the cold loads.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraplex.bench.metrics import percentile
from loraplex.bench.report import _ms, commit, cpu_flags, machine

HIT, HOST, COLD = ("slots",), ("cpu",), ("disk", "failed")


@dataclass(frozen=True)
class ScaleOutSpec:
    """The workload and each replica's engine (counts; lengths in tokens)."""

    num_adapters: int = 32
    alphas: tuple[float, ...] = (1.0, 2.0)  # one workload each: Zipf 1 (S-LoRA's), and one hot adapter
    num_requests: int = 160
    concurrency: int = 16
    prompt_len: tuple[int, int] = (32, 128)  # uniform, inclusive
    max_tokens: int = 16
    rank: int = 8
    max_loras: int = 4
    max_lora_rank: int = 8
    max_cpu_loras: int = 16
    max_num_seqs: int = 16
    num_cpus: int = 2  # the local Ray instance's CPUs (`--threads`), split evenly among the replicas
    configs: tuple[tuple[int, str], ...] = ((1, "affinity"), (2, "affinity"), (2, "pow2"))
    seed: int = 0
    dtype: str = "auto"


@dataclass
class Call:
    """One request's draw and what came back; times are seconds from the run's start."""

    adapter: str
    prompt: list[int]
    sent_s: float = 0.0
    first_s: float | None = None
    done_s: float | None = None
    replica: str | None = None
    tier: str | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


@dataclass
class Run:
    alpha: float
    replicas: int
    router: str
    calls: list[Call]
    duration_s: float
    start_s: float = 0.0  # seconds from ray.init to the application answering
    names: dict[str, str] = field(default_factory=dict)  # replica id -> short name (r1, r2, ...)

    @property
    def name(self) -> str:
        return f"{self.replicas} replica{'s' if self.replicas > 1 else ''}, {self.router}"

    def count(self, tiers: tuple[str, ...]) -> int:
        return sum(c.tier in tiers for c in self.calls)

    @property
    def hit_rate(self) -> float:
        return self.count(HIT) / len(self.calls)

    @property
    def tokens_per_s(self) -> float:
        return sum(c.completion_tokens for c in self.calls) / self.duration_s

    def ttft(self, q: float) -> float | None:
        return percentile([c.ttft_s for c in self.calls if c.ttft_s is not None], q)

    def per_replica(self) -> dict[str, tuple[int, int]]:
        """Short replica name -> (requests, distinct adapters) it ran."""
        by = {}
        for rid, short in self.names.items():
            mine = [c for c in self.calls if c.replica == rid]
            by[short] = (len(mine), len({c.adapter for c in mine}))
        return by


def draw(spec: ScaleOutSpec, alpha: float, vocab_size: int) -> list[Call]:
    """The requests, in send order: Zipf(alpha) adapter names a0..a{n-1} and random prompts."""
    rng = random.Random(spec.seed)
    names = [f"a{i}" for i in range(spec.num_adapters)]
    weights = [1 / (i + 1) ** alpha for i in range(spec.num_adapters)]
    calls = []
    for _ in range(spec.num_requests):
        n = rng.randint(*spec.prompt_len)
        calls.append(Call(rng.choices(names, weights)[0], [rng.randrange(100, vocab_size) for _ in range(n)]))
    return calls


async def _send(client: httpx.AsyncClient, call: Call, spec: ScaleOutSpec, start: float) -> None:
    """Stream one completion into `call`; a failure is the call's error, not the run's."""
    call.sent_s = time.perf_counter() - start
    body = {"model": call.adapter, "prompt": call.prompt, "max_tokens": spec.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                call.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            call.replica = r.headers.get("x-loraplex-replica")
            call.tier = r.headers.get("x-loraplex-adapter-tier")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    call.error = str(chunk["error"])
                    return
                if call.first_s is None and any(c.get("text") for c in chunk.get("choices", [])):
                    call.first_s = time.perf_counter() - start
                if chunk.get("usage"):
                    call.completion_tokens = chunk["usage"]["completion_tokens"]
        call.done_s = time.perf_counter() - start
    except httpx.HTTPError as exc:
        call.error = f"{type(exc).__name__}: {exc}"


async def _replay(url: str, key: str, calls: list[Call], spec: ScaleOutSpec) -> float:
    """Send `calls` from `spec.concurrency` closed-loop clients; returns the run's seconds."""
    from loraplex.bench.http_client import LOCAL, _auth

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=_auth(key), limits=limits, **LOCAL) as client:
        queue = iter(calls)
        start = time.perf_counter()

        async def worker() -> None:
            for call in queue:  # one shared iterator: each worker takes the next request
                await _send(client, call, spec, start)

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        return time.perf_counter() - start


def run_one(alpha: float, replicas: int, router: str, spec: ScaleOutSpec, calls: list[Call],
            adapter_dirs: dict[str, Path], redis_url: str, workdir: Path) -> Run:
    """One configuration on a fresh local Ray instance, home (database, adapter store) and Redis database."""
    import ray
    import redis
    from ray import serve

    from loraplex.bench.http_client import LOCAL, _auth, free_port, make_tenants
    from loraplex.engine.loader import loraplex_home
    from loraplex.platform.config import Settings
    from loraplex.platform.scaleout import app as scaleout
    from loraplex.platform.security import new_key

    redis.Redis.from_url(redis_url).flushall()
    home = Path(tempfile.mkdtemp(prefix="home-", dir=workdir))
    (home / "models").symlink_to(loraplex_home() / "models", target_is_directory=True)
    settings = Settings(home=home, port=free_port(), admin_key=new_key(), redis_url=redis_url, dtype=spec.dtype,
                        max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
                        max_cpu_loras=spec.max_cpu_loras, max_num_seqs=spec.max_num_seqs, max_queue_wait_s=None)
    url = f"http://127.0.0.1:{settings.port}"
    started = time.perf_counter()
    ray.init(num_cpus=spec.num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        scaleout.start(settings, num_replicas=replicas, num_ingresses=1, router=router,
                       replica_cpus=spec.num_cpus / replicas)
        ready_s = time.perf_counter() - started
        with httpx.Client(base_url=url, headers=_auth(settings.admin_key.get_secret_value()), **LOCAL) as admin:
            key = make_tenants(admin, {"bench": sorted(adapter_dirs)}, adapter_dirs)["bench"]
        with httpx.Client(base_url=url, headers=_auth(key), **LOCAL) as tenant:  # the base model, on each replica
            base = tenant.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            for _ in range(2 * replicas):
                tenant.post("/v1/completions", json={"model": base, "prompt": "Hello", "max_tokens": 2}
                            ).raise_for_status()
        mine = [Call(c.adapter, c.prompt) for c in calls]
        duration = asyncio.run(_replay(url, key, mine, spec))
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(home, ignore_errors=True)
    errors = [c.error for c in mine if c.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(mine)} requests failed on {replicas} replica(s), {router}; "
                           f"first: {errors[0]}")
    order = sorted({c.replica for c in mine}, key=lambda r: min(i for i, c in enumerate(mine) if c.replica == r))
    return Run(alpha, replicas, router, mine, duration, ready_s, {r: f"r{i + 1}" for i, r in enumerate(order)})


def run_all(spec: ScaleOutSpec, workdir: Path) -> list[Run]:
    from loraplex.adapters.synthetic import write_random_adapter
    from loraplex.engine.loader import DEFAULT_MODEL, load_config, resolve_model
    from loraplex.model_config import ModelConfig

    cfg = ModelConfig.from_hf_config(load_config(resolve_model(DEFAULT_MODEL)))
    dirs = {}
    for i in range(spec.num_adapters):
        dirs[f"a{i}"] = workdir / "adapters" / f"a{i}"
        write_random_adapter(dirs[f"a{i}"], cfg, r=spec.rank, alpha=2 * spec.rank,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=i)
    from loraplex.bench.http_client import RedisServer

    redis_server = RedisServer().start()  # more than one replica shares its quotas through Redis
    redis_url = redis_server.url
    try:
        runs = []
        for alpha in spec.alphas:
            calls = draw(spec, alpha, cfg.vocab_size)
            for replicas, router in spec.configs:
                print(f"scale-out: Zipf alpha {alpha:g}, {replicas} replica(s), {router} routing", flush=True)
                runs.append(run_one(alpha, replicas, router, spec, calls, dirs, redis_url, workdir))
                r = runs[-1]
                print(f"  slot hits {r.hit_rate:.1%}, cold loads {r.count(COLD)}, {r.tokens_per_s:.1f} tok/s, "
                      f"TTFT p99 {_ms(r.ttft(99))} ms", flush=True)
    finally:
        redis_server.kill()
    return runs


def write_report(out: Path, runs: list[Run], spec: ScaleOutSpec, *, command: str) -> None:
    lines = [
        "# Scale-out on Ray Serve: adapter affinity against Ray's default routing",
        "",
        f"Command: `{command}` · commit {commit()} · {machine()} · CPU flags: {cpu_flags()} · dtype {spec.dtype} · "
        f"a local Ray instance of {spec.num_cpus} CPUs, one gateway ingress, Redis quotas, SQLite; client, "
        "ingress and replicas on the same cores",
        "",
        f"Workload (`loraplex/bench/scaleout.py`): one tenant, {spec.num_adapters} random rank-{spec.rank} adapters "
        f"(q/k/v/o), {spec.num_requests} streamed completions drawn Zipf(alpha) over them, prompts of "
        f"{spec.prompt_len[0]}-{spec.prompt_len[1]} random tokens, {spec.max_tokens} greedy output tokens with "
        f"`ignore_eos`, sent by {spec.concurrency} closed-loop clients in the same order on every configuration "
        f"of a workload. Each replica: {spec.max_loras} adapter slots of rank {spec.max_lora_rank}, "
        f"{spec.max_cpu_loras} adapters in host memory, at most {spec.max_num_seqs} running requests, "
        f"{spec.num_cpus} CPUs split evenly among the replicas (threads). Every configuration starts cold: a "
        "fresh Ray instance, database and adapter store, adapters uploaded, one base-model warm-up call per "
        "replica.",
        "",
        "Where each request's adapter was on the replica that ran it, when it arrived (response header "
        "`x-loraplex-adapter-tier`): **slot hit** in an adapter slot; **host hit** in host memory (a copy into a "
        "slot); **cold load** only in the shared store (its files read); **reading**: being read for an "
        "earlier request.",
        "",
    ]
    for alpha in dict.fromkeys(r.alpha for r in runs):
        mine = [r for r in runs if r.alpha == alpha]
        share = Counter(c.adapter for c in mine[0].calls)
        top, n_top = share.most_common(1)[0]
        lines += [
            f"## Zipf alpha {alpha:g}",
            "",
            f"{len(share)} of the {spec.num_adapters} adapters drawn; the most used, {top}, has {n_top} of the "
            f"{len(mine[0].calls)} requests.",
            "",
            "| configuration | slot hit rate | host hits | cold loads | reading | requests / distinct adapters per "
            "replica | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | app ready (s) |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in mine:
            per = ", ".join(f"{name} {n} / {k}" for name, (n, k) in r.per_replica().items())
            lines.append(f"| {r.name} | {r.hit_rate:.1%} | {r.count(HOST)} | {r.count(COLD)} | "
                         f"{r.count(('loading',))} | {per} | {r.tokens_per_s:.1f} | {_ms(r.ttft(50))} | "
                         f"{_ms(r.ttft(99))} | {r.start_s:.0f} |")
        lines.append("")
    lines += [
        "Routers: **affinity** is `AdapterAffinityRouter` (docs/scale-out.md: stay on a replica holding the "
        "adapter while its queue is within `LORAPLEX_AFFINITY_SLACK` (8) of the shortest, else the least loaded); "
        "**pow2** is Ray Serve's default `PowerOfTwoChoicesRequestRouter`, which also reads the replicas' "
        "`serve.multiplexed` reports: two random choices among the replicas that report the adapter, then "
        "among those with the fewest adapters, then all.",
        "",
        f"On this machine the replicas share {spec.num_cpus} cores (each of 2 replicas runs 1 thread, 1 replica "
        f"runs {spec.num_cpus}), and the client and the ingress run on them too, so output tokens/s and TTFT across "
        "replica counts say how the cores were shared, not what a second machine adds; what routing changes is "
        "the hit rate and the cold loads, which do not depend on the cores, and how evenly the replicas are "
        "loaded.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
