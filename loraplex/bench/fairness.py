"""`loraplex bench --preset fairness`: a noisy tenant at 8x a quiet tenant's rate, under "fcfs" and
"fair", and the quiet tenant alone, on one engine (`AsyncLLM`, its step loop on the main thread as in
`loraplex serve`, the clients on an asyncio loop in a second thread).

The noisy tenant sends open-loop Poisson arrivals at `noisy_factor` x `quiet_rate`; the quiet tenant
is one interactive user who sends a request, waits for the whole answer, thinks for an exponential time
of mean 1 / `quiet_rate`, and sends the next (the issue's "one at a time"). Prompts are random token
ids, sampling greedy with `ignore_eos`, so each request makes exactly its max_tokens. The noisy
tenant's offered load is past what the engine serves, so its requests queue; that is the point: under
"fcfs" the quiet tenant's requests wait behind that queue, under "fair" they do not
(`loraplex.engine.fair_share`).

Measured per run (times in seconds from the run's start, TTFT as the client sees it: from its call to
the first token):
- per tenant: requests, TTFT p50/p99 of the requests that arrived in the window, and output tokens
  served per second within the window;
- total output tokens/s within the window (the engine's throughput; the noisy tenant's queue keeps
  it busy in both policies);
- output tokens served per tenant per `BIN_S`-second bin (the plot: service over time).
After the arrival window the run waits for every quiet request's first token (up to `DRAIN_S`) and then
ends the rest; nothing after the window counts in throughput.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.bench.metrics import percentile
from loraplex.bench.report import _ms, _plot, _ratio, commit, cpu_flags, machine
from loraplex.engine.async_llm import AsyncLLM
from loraplex.engine.sampling_params import SamplingParams

BIN_S = 5.0
DRAIN_S = 300.0
REPEATS = 5
QUIET, NOISY = 1, 2  # tenant ids


@dataclass(frozen=True)
class FairnessSpec:
    """The workload: rates in requests/s, token ranges inclusive."""

    duration_s: float = 45.0
    quiet_rate: float = 0.4
    noisy_factor: float = 8.0
    quiet_prompt: tuple[int, int] = (128, 256)  # the noisy tenant's lengths: it differs only in rate and output
    quiet_max_tokens: int = 16
    noisy_prompt: tuple[int, int] = (128, 256)
    noisy_max_tokens: int = 128
    max_num_seqs: int = 16
    seed: int = 0


@dataclass
class Record:
    tenant: int
    arrival_s: float
    first_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per output token, when it arrived

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.arrival_s


@dataclass
class Run:
    name: str
    records: list[Record]
    duration_s: float
    num_preemptions: int

    def of(self, tenant: int) -> list[Record]:
        return [r for r in self.records if r.tenant == tenant]

    def ttft(self, tenant: int, q: float) -> float | None:
        return percentile([r.ttft_s for r in self.of(tenant) if r.ttft_s is not None], q)

    def tokens_per_s(self, tenant: int | None = None) -> float:
        recs = self.records if tenant is None else self.of(tenant)
        return sum(t <= self.duration_s for r in recs for t in r.token_times) / self.duration_s

    def served_by_bin(self, tenant: int) -> tuple[list[float], list[float]]:
        n = int(self.duration_s // BIN_S)
        counts = [0] * n
        for r in self.of(tenant):
            for t in r.token_times:
                if t < n * BIN_S:
                    counts[int(t // BIN_S)] += 1
        return [(i + 0.5) * BIN_S for i in range(n)], [c / BIN_S for c in counts]


def arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times in [0, duration_s)."""
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def plan(spec: FairnessSpec, vocab_size: int, with_noisy: bool
         ) -> tuple[list[tuple[float, list[int]]], list[tuple[float, list[int]]]]:
    """The quiet tenant's (think time, prompt) in order and the noisy tenant's (arrival, prompt) by arrival;
    the same draws in every run (the noisy list is empty without it)."""
    rng = random.Random(spec.seed)
    gaps, total = [], 0.0
    while total < spec.duration_s:
        gaps.append(rng.expovariate(spec.quiet_rate))
        total += gaps[-1]
    noisy = arrivals(spec.quiet_rate * spec.noisy_factor, spec.duration_s, rng) if with_noisy else []

    def prompt(key: tuple, lo_hi: tuple[int, int]) -> list[int]:
        prng = random.Random(hash((spec.seed, *key)))
        return [prng.randrange(vocab_size) for _ in range(prng.randint(*lo_hi))]

    return ([(g, prompt((QUIET, i), spec.quiet_prompt)) for i, g in enumerate(gaps)],
            [(t, prompt((NOISY, i), spec.noisy_prompt)) for i, t in enumerate(noisy)])


async def _client(llm: AsyncLLM, quiet, noisy, spec: FairnessSpec) -> tuple[list[Record], float]:
    """The noisy tenant open loop (each request at its arrival time), the quiet one as one interactive
    user: its next request a think time after the last one ended, while the window lasts."""
    start = time.perf_counter()
    records: list[Record] = []

    async def one(tenant: int, ids: list[int], max_tokens: int) -> None:
        rec = Record(tenant, time.perf_counter() - start)
        records.append(rec)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for out in llm.generate(ids, params, tenant_id=tenant):
            now = time.perf_counter() - start
            if out.delta_token_ids and rec.first_s is None:
                rec.first_s = now
            rec.token_times.extend([now] * len(out.delta_token_ids))

    async def at(arrival: float, ids: list[int]) -> None:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        await one(NOISY, ids, spec.noisy_max_tokens)

    async def user() -> None:
        for gap, ids in quiet:
            await asyncio.sleep(gap)
            if time.perf_counter() - start >= spec.duration_s:
                return
            await one(QUIET, ids, spec.quiet_max_tokens)

    tasks = [asyncio.create_task(at(t, ids)) for t, ids in noisy]
    quiet_user = asyncio.create_task(user())
    await asyncio.sleep(spec.duration_s)
    try:  # the quiet request still out when the window closes gets its first token (fcfs: at last)
        await asyncio.wait_for(asyncio.shield(quiet_user), DRAIN_S)
    except asyncio.TimeoutError:
        pass
    for task in [*tasks, quiet_user]:
        task.cancel()  # leaving generate() aborts the request
    await asyncio.gather(*tasks, quiet_user, return_exceptions=True)
    return records, spec.duration_s


def run_one(name: str, policy: str, spec: FairnessSpec, *, with_noisy: bool, threads: int, dtype: str) -> Run:
    """One run on a fresh engine: warm it up, then the workload; the step loop on this thread."""
    llm = AsyncLLM(start=False, dtype=dtype, num_threads=threads, scheduling_policy=policy,
                   max_num_seqs=spec.max_num_seqs, max_queue_wait_s=None, max_num_waiting_seqs=100_000,
                   max_num_waiting_tokens=1 << 40)
    vocab = llm.engine.model_config.vocab_size
    quiet, noisy = plan(spec, vocab, with_noisy)
    result: dict = {}

    def client() -> None:
        async def main():
            warm = random.Random(1)
            await asyncio.gather(*[_drain(llm.generate([warm.randrange(vocab) for _ in range(200)],
                                                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
                                   for _ in range(spec.max_num_seqs)])
            result["preemptions_before"] = llm.engine.scheduler.num_preemptions
            result["records"], result["duration"] = await _client(llm, quiet, noisy, spec)
        try:
            asyncio.run(main())
        finally:
            llm.shutdown()

    thread = threading.Thread(target=client, name="fairness-clients")
    thread.start()
    llm.run()
    thread.join()
    return Run(name, result["records"], result["duration"],
               llm.engine.scheduler.num_preemptions - result["preemptions_before"])


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def run_all(spec: FairnessSpec, threads: int, dtype: str, repeats: int = REPEATS) -> list[Run]:
    """The quiet tenant alone, then fcfs and fair in turn, `repeats` times each: on this VM the same
    policy's throughput varied by 10% from one 45 s run to the next, so a few pairs are pooled to tell a
    few percent apart."""
    order = [("quiet alone", "fair", False)] + [(p, p, True) for _ in range(repeats) for p in ("fcfs", "fair")]
    runs = []
    for name, policy, noisy in order:
        print(f"fairness: {name} ({spec.duration_s:.0f} s of arrivals)", flush=True)
        runs.append(run_one(name, policy, spec, with_noisy=noisy, threads=threads, dtype=dtype))
    return runs


def pooled(runs: list[Run], name: str) -> Run:
    """The runs called `name` as one: their records together, their windows end to end (tokens after a
    run's window are left out, as in `Run.tokens_per_s`; TTFTs are kept whenever the first token came)."""
    mine = [r for r in runs if r.name == name]
    records = []
    for i, r in enumerate(mine):  # shift each run's times past the last one's window
        shift = i * r.duration_s
        records += [Record(x.tenant, x.arrival_s + shift, None if x.first_s is None else x.first_s + shift,
                           [t + shift for t in x.token_times if t <= r.duration_s]) for x in r.records]
    return Run(name, records, sum(r.duration_s for r in mine), sum(r.num_preemptions for r in mine))


def write_report(out: Path, runs: list[Run], spec: FairnessSpec, *, command: str, threads: int, dtype: str) -> None:
    """Each run's row, then the checks on the runs of each policy pooled (`pooled`); the plots show the
    first fcfs and fair runs."""
    first = {n: next(r for r in runs if r.name == n) for n in ("fcfs", "fair")}
    solo, fcfs, fair = (pooled(runs, n) for n in ("quiet alone", "fcfs", "fair"))
    plot = out.with_name(out.stem + "-service.png")
    series = {}
    for run in first.values():
        for tenant, label in ((NOISY, "noisy"), (QUIET, "quiet")):
            series[f"{run.name}: {label}"] = run.served_by_bin(tenant)
    _plot(plot, series, "seconds into the run", "output tokens served per second")
    ttft_plot = out.with_name(out.stem + "-quiet-ttft.png")
    _plot(ttft_plot, {r.name: ([x.arrival_s for x in r.of(QUIET) if x.ttft_s is not None],
                               [x.ttft_s for x in r.of(QUIET) if x.ttft_s is not None])
                      for r in (solo, *first.values())},
          "arrival (s into the run)", "quiet tenant's TTFT (s)")
    p99 = {r.name: r.ttft(QUIET, 99) for r in (solo, fcfs, fair)}
    ratio = fair.tokens_per_s() / fcfs.tokens_per_s() if fcfs.tokens_per_s() else None
    lines = [
        "# Fair share: a quiet tenant beside a noisy one",
        "",
        f"Command: `{command}` · commit {commit()} · {machine()} · CPU flags: {cpu_flags()} · dtype {dtype}, "
        f"{threads} engine threads",
        "",
        f"Workload (`loraplex/bench/fairness.py`): a {spec.duration_s:.0f} s window; the quiet tenant is one user "
        f"who sends a request, waits for the answer and thinks for an exponential time of mean "
        f"{1 / spec.quiet_rate:g} s ({spec.quiet_rate:g} req/s), prompts {spec.quiet_prompt[0]}-"
        f"{spec.quiet_prompt[1]} tokens, {spec.quiet_max_tokens} output tokens; the noisy tenant sends Poisson "
        f"arrivals at {spec.noisy_factor:g}x that rate, prompts "
        f"{spec.noisy_prompt[0]}-{spec.noisy_prompt[1]} tokens, {spec.noisy_max_tokens} output tokens "
        f"(past the engine's capacity, so its requests queue); greedy, `ignore_eos`; max_num_seqs "
        f"{spec.max_num_seqs}; no queue bound (nothing shed). TTFT from the client's call to its first token.",
        "",
        "| run | tenant | requests | TTFT p50 (ms) | TTFT p99 (ms) | output tokens/s served | preemptions |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    numbered = [Run(f"{r.name} #{sum(x.name == r.name for x in runs[:i + 1])}", r.records, r.duration_s,
                    r.num_preemptions) for i, r in enumerate(runs)]
    for run in numbered + [Run(f"**{r.name}, pooled**", r.records, r.duration_s, r.num_preemptions)
                           for r in (fcfs, fair)]:
        for tenant, label in ((QUIET, "quiet"), (NOISY, "noisy")):
            if run.of(tenant):
                lines.append(f"| {run.name} | {label} | {len(run.of(tenant))} | {_ms(run.ttft(tenant, 50))} | "
                             f"{_ms(run.ttft(tenant, 99))} | {run.tokens_per_s(tenant):.1f} | {run.num_preemptions} |")
    lines += [
        "",
        f"Runs in this order: {', '.join(r.name for r in numbered)}. The checks pool the runs of each "
        "policy (TTFT percentiles over all their requests, throughput over all their windows).",
        "",
        "| check (issue 19's \"done when\") | value | target |",
        "|---|---:|---|",
        f"| quiet p99 TTFT, fair / quiet alone | {_ratio(p99['fair'], p99['quiet alone'])} | at most 3x |",
        f"| quiet p99 TTFT, fair / fcfs | {_ratio(p99['fair'], p99['fcfs'])} | at most 0.5x |",
        f"| total output tokens/s, fair / fcfs | {'–' if ratio is None else f'{ratio:.3f}x'} "
        f"({fair.tokens_per_s():.1f} / {fcfs.tokens_per_s():.1f}) | at least 0.95x |",
        "",
        f"![output tokens served per tenant over time]({plot.name})",
        "",
        f"![the quiet tenant's TTFT by arrival]({ttft_plot.name})",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
