"""`loraplex bench --preset prefix-cache`: chat traffic that repeats itself, through a real `loraplex serve`
with prefix caching on and off (`LORAPLEX_ENABLE_PREFIX_CACHING`), driven by the official `openai` client
with streaming, as a tenant's app would call it.

Two workloads per server, the same draws on both:
- **shared system prompt** (issue 20's check): one tenant sends `num_shared` chats one after another,
  each its ~`system_tokens`-token system prompt and a different short question. Reported: each request's
  TTFT and `usage.prompt_tokens_details.cached_tokens`; the first one's TTFT against the mean of the rest.
- **multi-turn**: `num_tenants` tenants, tenant 0 on the base model and tenant i on its own rank-8 adapter
  (q/k/v/o); each tenant has its own system prompt and `users_per_tenant` users. A user sends a question,
  reads the streamed answer, thinks for an exponential time (mean `think_s`), and sends the next turn
  with the whole conversation so far, `turns` times. All users start together. Reported: TTFT p50/p99
  (all turns, and the first turn apart), output tokens/s over the run, and the hit rate (cached over
  prompt tokens, from the usage chunks; the engine's counters beside it).

TTFT is the client's: from its call to the first chunk with text. Runs alternate on, off, on, off... so
that the VM's drift falls on both. Greedy decoding with `ignore_eos`, so every answer has `max_tokens`
tokens whatever the cache does; the text of an answer is identical on and off (checked and reported).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.bench.metrics import percentile
from loraplex.bench.report import _ms, _ratio, commit, cpu_flags, machine

WORDS = ("order delivery window refund supervisor warehouse invoice parcel customer address account payment "
         "return exchange courier tracking schedule discount voucher priority shipment record carrier policy "
         "weekend holiday weight box damaged missing label store branch manager approval receipt").split()


@dataclass(frozen=True)
class PrefixSpec:
    """The workloads: prompt sizes in tokens, times in seconds."""

    system_tokens: int = 700
    num_shared: int = 8
    shared_max_tokens: int = 8
    num_tenants: int = 4
    users_per_tenant: int = 2
    turns: int = 4
    max_tokens: int = 32
    think_s: float = 1.0
    repeats: int = 2
    seed: int = 0
    dtype: str = "auto"  # the server's LORAPLEX_DTYPE


@dataclass
class Turn:
    """One streamed chat: who sent it, when (seconds from the run's start), what came back."""

    tenant: int
    user: int
    turn: int
    sent_s: float
    first_s: float | None = None
    done_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


@dataclass
class Run:
    caching: bool
    shared: list[Turn]
    turns: list[Turn]
    duration_s: float  # of the multi-turn workload
    engine_hits: int = 0  # prefix cache counters of the server over the multi-turn workload (tokens)
    engine_queries: int = 0

    @property
    def name(self) -> str:
        return "on" if self.caching else "off"

    def ttft(self, q: float, first_turn: bool | None = None) -> float | None:
        return percentile([t.ttft_s for t in self.turns if t.ttft_s is not None
                           and (first_turn is None or (t.turn == 0) == first_turn)], q)

    @property
    def tokens_per_s(self) -> float:
        return sum(t.completion_tokens for t in self.turns) / self.duration_s

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0


@dataclass
class Plan:
    """Text for every request, drawn once: each tenant's system prompt, each user's questions."""

    systems: list[str]
    questions: dict[tuple[int, int], list[str]]  # (tenant, user) -> one question per turn
    shared_system: str
    shared_questions: list[str]
    adapters: list[str | None] = field(default_factory=list)  # per tenant: None is the base model


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def system_prompt(rng: random.Random, tokenizer, num_tokens: int, name: str) -> str:
    """Rules of a made-up support desk, grown sentence by sentence to at least `num_tokens` tokens."""
    text = f"You are the support assistant of {name}. Follow these rules."
    i = 0
    while len(tokenizer.encode(text)) < num_tokens:
        i += 1
        text += f" Rule {i}: {_sentence(rng, 12)}"
    return text


def make_plan(spec: PrefixSpec, tokenizer) -> Plan:
    rng = random.Random(spec.seed)
    systems = [system_prompt(rng, tokenizer, spec.system_tokens, f"shop {t}") for t in range(spec.num_tenants)]
    questions = {(t, u): [_sentence(rng, 8).rstrip(".") + "?" for _ in range(spec.turns)]
                 for t in range(spec.num_tenants) for u in range(spec.users_per_tenant)}
    shared = system_prompt(rng, tokenizer, spec.system_tokens, "Northwind Traders")
    return Plan(systems, questions, shared, [_sentence(rng, 6).rstrip(".") + "?" for _ in range(spec.num_shared)],
                [None] + [f"helper-{t}" for t in range(1, spec.num_tenants)])


async def stream_chat(client, model: str, messages: list[dict], max_tokens: int, rec: Turn, start: float) -> Turn:
    """Stream one chat into `rec` (times from `start`); a failure is the record's error, not the run's."""
    rec.sent_s = time.perf_counter() - start
    pieces, usage = [], None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            for choice in chunk.choices:
                if rec.first_s is None and choice.delta.content:
                    rec.first_s = time.perf_counter() - start
                pieces.append(choice.delta.content or "")
            usage = chunk.usage or usage
        rec.done_s = time.perf_counter() - start
    except Exception as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.text = "".join(pieces)
    if usage is None:
        rec.error = "no usage chunk"
    else:
        rec.prompt_tokens, rec.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        details = usage.prompt_tokens_details
        rec.cached_tokens = details.cached_tokens if details is not None and details.cached_tokens else 0
    return rec


async def _workloads(url: str, admin_key: str, keys: list[str], base_model: str, plan: Plan, spec: PrefixSpec
                     ) -> tuple[list[Turn], list[Turn], float, dict, dict]:
    """Both workloads on one server; returns their turns, the multi-turn run's seconds and the server's
    prefix cache counters before and after it (`GET /admin/engine`)."""
    import httpx
    import openai

    from loraplex.bench.http_client import LOCAL, _auth

    async def cache_counters() -> dict:
        async with httpx.AsyncClient(base_url=url, headers=_auth(admin_key), **LOCAL) as admin:
            return (await admin.get("/admin/engine")).raise_for_status().json()["prefix_cache"]

    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=3600.0,
                                  http_client=openai.DefaultAsyncHttpxClient(trust_env=False)) for k in keys]
    model = [a or base_model for a in plan.adapters]
    try:
        # warm-up: every model once, on text that shares nothing with the workloads
        for t, client in enumerate(clients):
            await stream_chat(client, model[t], [{"role": "user", "content": "Warm up."}], 2, Turn(t, 0, 0, 0.0),
                              time.perf_counter())
        start = time.perf_counter()
        shared = []
        for i, q in enumerate(plan.shared_questions):  # tenant 0, one request after another
            messages = [{"role": "system", "content": plan.shared_system}, {"role": "user", "content": q}]
            shared.append(await stream_chat(clients[0], base_model, messages, spec.shared_max_tokens,
                                            Turn(0, 0, i, 0.0), start))
        rng = random.Random(spec.seed + 1)
        thinks = {key: [rng.expovariate(1 / spec.think_s) for _ in range(spec.turns)] for key in plan.questions}
        turns: list[Turn] = []

        async def user(t: int, u: int) -> None:
            messages = [{"role": "system", "content": plan.systems[t]}]
            for k, q in enumerate(plan.questions[(t, u)]):
                messages.append({"role": "user", "content": q})
                rec = await stream_chat(clients[t], model[t], messages, spec.max_tokens, Turn(t, u, k, 0.0), start)
                turns.append(rec)
                if rec.error is not None:
                    return
                messages.append({"role": "assistant", "content": rec.text})
                await asyncio.sleep(thinks[(t, u)][k])

        before = await cache_counters()
        start = time.perf_counter()
        await asyncio.gather(*(user(t, u) for t, u in plan.questions))
        duration = time.perf_counter() - start
        after = await cache_counters()
    finally:
        for c in clients:
            await c.close()
    return shared, turns, duration, before, after


def run_one(caching: bool, plan: Plan, spec: PrefixSpec, adapter_dirs: dict[str, Path], threads: int,
            log_path: Path | None = None) -> Run:
    """Start a server, make the tenants and upload their adapters, run both workloads, read its counters."""
    import httpx

    from loraplex.bench.http_client import LOCAL, _auth, _check, make_tenants, serve_subprocess

    env = {"LORAPLEX_ENABLE_PREFIX_CACHING": "true" if caching else "false", "LORAPLEX_NUM_THREADS": str(threads),
           "LORAPLEX_DTYPE": spec.dtype}
    names = [f"shop-{t}" for t in range(len(plan.adapters))]
    with serve_subprocess(env, log_path=log_path) as server:
        with httpx.Client(base_url=server.url, headers=_auth(server.admin_key), **LOCAL) as admin:
            by_name = make_tenants(admin, {n: [a] if a else [] for n, a in zip(names, plan.adapters, strict=True)},
                                   adapter_dirs)
            keys = [by_name[n] for n in names]
            base_model = _check(admin.get("/admin/engine"), "engine")["model"]
            shared, turns, duration, before, after = asyncio.run(
                _workloads(server.url, server.admin_key, keys, base_model, plan, spec))
    run = Run(caching, shared, turns, duration, after["num_hit_tokens"] - before["num_hit_tokens"],
              after["num_query_tokens"] - before["num_query_tokens"])
    errors = [t.error for t in shared + turns if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed with caching {run.name}; first: {errors[0]}")
    return run


def run_all(spec: PrefixSpec, threads: int, workdir: Path) -> list[Run]:
    from transformers import AutoTokenizer

    from loraplex.adapters.synthetic import write_random_adapter
    from loraplex.engine.loader import DEFAULT_MODEL, load_config, resolve_model
    from loraplex.model_config import ModelConfig

    path = resolve_model(DEFAULT_MODEL)
    plan = make_plan(spec, AutoTokenizer.from_pretrained(path))
    cfg = ModelConfig.from_hf_config(load_config(path))
    dirs = {}
    for i, name in enumerate(a for a in plan.adapters if a is not None):
        dirs[name] = workdir / name
        write_random_adapter(dirs[name], cfg, r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                             seed=i)
    runs = []
    for i in range(spec.repeats):
        for caching in (True, False):
            print(f"prefix-cache: caching {'on' if caching else 'off'}, run {i + 1} of {spec.repeats}", flush=True)
            runs.append(run_one(caching, plan, spec, dirs, threads, workdir / f"serve-{len(runs)}.log"))
    return runs


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def shared_check(run: Run) -> tuple[float | None, float | None, int]:
    """First request's TTFT, the mean TTFT of the rest, and the fewest cached tokens among the rest."""
    first, rest = run.shared[0], run.shared[1:]
    return first.ttft_s, _mean([t.ttft_s for t in rest if t.ttft_s is not None]), min(t.cached_tokens for t in rest)


def pooled(runs: list[Run], caching: bool) -> Run:
    mine = [r for r in runs if r.caching == caching]
    return Run(caching, [t for r in mine for t in r.shared], [t for r in mine for t in r.turns],
               sum(r.duration_s for r in mine), sum(r.engine_hits for r in mine), sum(r.engine_queries for r in mine))


def write_report(out: Path, runs: list[Run], spec: PrefixSpec, *, command: str, threads: int) -> None:
    on, off = pooled(runs, True), pooled(runs, False)
    equal, first_equal = answers_equal(runs)
    lines = [
        "# Prefix caching: a shared system prompt and multi-turn chats",
        "",
        f"Command: `{command}` · commit {commit()} · {machine()} · CPU flags: {cpu_flags()} · dtype {spec.dtype}, "
        f"{threads} engine threads · through `loraplex serve` and the `openai` client (streaming), client and "
        "server on the same cores",
        "",
        f"Workloads (`loraplex/bench/prefix_cache.py`): **shared system prompt**: one tenant sends {spec.num_shared} "
        f"chats one after another, each a ~{spec.system_tokens}-token system prompt and a different question, "
        f"{spec.shared_max_tokens} output tokens. **Multi-turn**: {spec.num_tenants} tenants (one on the base model, "
        f"{spec.num_tenants - 1} on their own rank-8 q/k/v/o adapters), each with its own ~{spec.system_tokens}-token "
        f"system prompt and {spec.users_per_tenant} users; a user sends {spec.turns} turns, each with the whole "
        f"conversation so far, {spec.max_tokens} output tokens (greedy, `ignore_eos`), thinking an exponential "
        f"{spec.think_s:g} s (mean) between turns; all users start together. TTFT: the client's call to its first "
        f"text chunk. Runs alternate on/off, {spec.repeats} of each, pooled below.",
        "",
        "## Shared system prompt (issue 20's check)",
        "",
        "| run | prompt tokens | cached tokens, requests 2+ (fewest) | TTFT of request 1 (ms) | mean TTFT, requests 2+ (ms) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    numbered = [(f"{r.name} #{sum(x.caching == r.caching for x in runs[:i + 1])}", r) for i, r in enumerate(runs)]
    for name, r in numbered:
        first, rest, fewest = shared_check(r)
        lines.append(f"| {name} | {r.shared[0].prompt_tokens} | {fewest} | {_ms(first)} | {_ms(rest)} | "
                     f"{_ratio(rest, first)} |")
    lines += [
        "",
        "Each request's cached tokens and TTFT (ms), first run of each:",
        "",
        "| request | " + " | ".join(f"caching {n}: cached / TTFT" for n in ("on", "off")) + " |",
        "|---:|---:|---:|",
    ]
    first_on, first_off = (next(r for r in runs if r.caching == c) for c in (True, False))
    for i, (a, b) in enumerate(zip(first_on.shared, first_off.shared, strict=True)):
        lines.append(f"| {i + 1} | {a.cached_tokens} / {_ms(a.ttft_s)} | {b.cached_tokens} / {_ms(b.ttft_s)} |")
    lines += [
        "",
        "## Multi-turn chats",
        "",
        "| run | requests | TTFT p50 (ms) | TTFT p99 (ms) | first-turn TTFT p50 (ms) | later-turn TTFT p50 (ms) | "
        "output tokens/s | hit rate (usage) | engine hits / queries (tokens) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in numbered + [("**on, pooled**", on), ("**off, pooled**", off)]:
        lines.append(f"| {name} | {len(r.turns)} | {_ms(r.ttft(50))} | {_ms(r.ttft(99))} | "
                     f"{_ms(r.ttft(50, True))} | {_ms(r.ttft(50, False))} | {r.tokens_per_s:.1f} | "
                     f"{r.hit_rate:.1%} | {r.engine_hits:,} / {r.engine_queries:,} |")

    lines += [
        "",
        "| on / off (pooled) | value |",
        "|---|---:|",
        f"| TTFT p50 | {_ratio(on.ttft(50), off.ttft(50))} |",
        f"| TTFT p99 | {_ratio(on.ttft(99), off.ttft(99))} |",
        f"| later-turn TTFT p50 | {_ratio(on.ttft(50, False), off.ttft(50, False))} |",
        f"| output tokens/s | {_ratio(on.tokens_per_s, off.tokens_per_s)} |",
        "",
        f"Answers with caching on equal to the same run's answer with caching off, text for text: "
        f"{equal[0]} of {equal[1]} (first turns: {first_equal[0]} of {first_equal[1]}; a later turn's prompt "
        "holds the earlier answers, so one that differs changes the rest of its conversation). Greedy decoding "
        "is exact in fp32 (`tests/engine/test_parity.py`); in bf16 a prompt prefilled from a cached prefix "
        "runs other GEMM shapes than one prefilled whole, which may round a near tie the other way.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def answers_equal(runs: list[Run]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(equal, compared) over all multi-turn answers and over first turns, each caching-on run against the
    caching-off run of the same repeat."""
    pairs = [(a, b) for r_on, r_off in zip([r for r in runs if r.caching], [r for r in runs if not r.caching],
                                            strict=True)
             for a, b in zip(sorted(r_on.turns, key=_key), sorted(r_off.turns, key=_key), strict=True)]
    first = [(a, b) for a, b in pairs if a.turn == 0]
    return (sum(a.text == b.text for a, b in pairs), len(pairs)), (sum(a.text == b.text for a, b in first), len(first))


def _key(t: Turn) -> tuple[int, int, int]:
    return t.tenant, t.user, t.turn
