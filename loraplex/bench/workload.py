"""S-LoRA-style multi-tenant workloads: arrivals, adapter popularity, prompt and output lengths.

The shape follows S-LoRA's evaluation (Sheng et al., 2023, section 7): requests arrive as a Poisson
process of rate R (or a gamma process with coefficient of variation cv: cv 1 is Poisson, larger is
burstier), adapter i of n is picked with probability proportional to (i + 1) ** -alpha (alpha 0 is
uniform, 1 is Zipf), and prompt and output lengths are uniform in [min, max). Adapter ranks follow the
setting: S1 gives every adapter one rank, S2 cycles through {8, 16, 32, 64}.

A workload is a plain list of `BenchRequest`s, so one list feeds every system of a run (same prompts,
same adapters, same output lengths) and round-trips through a JSONL trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIRST_TOKEN_ID = 100  # the default model's ids below this are special and chat tokens
S2_RANKS = (8, 16, 32, 64)


@dataclass
class BenchRequest:
    """One request of a workload.

    arrival_s: seconds after the start of the run; adapter: None for the base model; prompt_token_ids:
    the prompt (random ids when the workload or trace only gives a length); output_len: tokens to make
    (EOS never stops a row).
    """

    arrival_s: float
    tenant: str
    adapter: str | None
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class WorkloadSpec:
    """The distribution of a workload; `generate` draws one from it with `seed`.

    num_adapters n (0: every request on the base model); alpha: popularity exponent; rate: requests
    per second (inf: all arrive at time 0); cv: coefficient of variation of the inter-arrival gaps;
    duration_s or num_requests bounds the workload (num_requests wins when both are set); prompt_len
    and output_len: [min, max) in tokens; setting "S1" (every adapter rank `rank`) or "S2" (ranks
    cycle through 8, 16, 32, 64); num_tenants: adapter i belongs to tenant i % num_tenants.
    """

    num_adapters: int = 8
    alpha: float = 1.0
    rate: float = 4.0
    cv: float = 1.0
    duration_s: float = 30.0
    num_requests: int | None = None
    prompt_len: tuple[int, int] = (8, 512)
    output_len: tuple[int, int] = (8, 512)
    setting: str = "S1"
    rank: int = 8
    num_tenants: int = 4
    seed: int = 0
    vocab_size: int = 49152

    def __post_init__(self) -> None:
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.cv <= 0:
            raise ValueError(f"cv must be > 0, got {self.cv}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo < hi:
                raise ValueError(f"{name} must be [min, max) with 1 <= min < max, got {(lo, hi)}")
        if self.setting not in ("S1", "S2"):
            raise ValueError(f"setting must be S1 or S2, got {self.setting!r}")
        if self.duration_s <= 0 or (self.num_requests is not None and self.num_requests < 1):
            raise ValueError("a workload needs duration_s > 0 and, when set, num_requests >= 1")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.num_requests is None and self.rate == float("inf"):
            raise ValueError("an infinite rate needs num_requests")

    def adapter_names(self) -> list[str]:
        """S1 and S2 adapters differ in rank, so they get different names: lora<i> and s2-lora<i>."""
        prefix = "lora" if self.setting == "S1" else "s2-lora"
        return [f"{prefix}{i}" for i in range(self.num_adapters)]

    def adapter_rank(self, i: int) -> int:
        return self.rank if self.setting == "S1" else S2_RANKS[i % len(S2_RANKS)]

    def tenant_of(self, adapter_index: int) -> str:
        return f"tenant{adapter_index % max(1, self.num_tenants)}"


@dataclass
class Workload:
    spec: WorkloadSpec | None
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def adapters(self) -> list[str]:
        return sorted({r.adapter for r in self.requests if r.adapter is not None})

    def without_adapters(self) -> Workload:
        """The same arrivals, prompts and lengths on the base model only (the upper bound)."""
        reqs = [BenchRequest(r.arrival_s, r.tenant, None, r.prompt_token_ids, r.output_len) for r in self.requests]
        return Workload(self.spec, reqs)

    def warm_up(self, num_requests: int = 32, output_len: int = 8) -> list[BenchRequest]:
        """The untimed warm-up of every system the bench runs (in process, over HTTP, vLLM): the first
        `num_requests` requests, all at time 0, at most `output_len` tokens each, so the first timed steps
        do not pay for first-touch allocations of a large batch (KV blocks, activations) and the most used
        adapters sit in their slots. Each prompt is reversed: the same lengths, token ids and adapters, but
        no KV block a prefix cache could serve to the timed request that starts the same way."""
        return [BenchRequest(0.0, r.tenant, r.adapter, r.prompt_token_ids[::-1], min(output_len, r.output_len))
                for r in self.requests[:num_requests]]


def generate(spec: WorkloadSpec) -> Workload:
    """Draw a workload from `spec`; the same spec (seed included) gives the same requests."""
    rng = random.Random(spec.seed)
    shape = 1.0 / spec.cv**2  # gamma gaps with mean 1/rate and this cv; shape 1 is exponential (Poisson)
    weights = [(i + 1) ** -spec.alpha for i in range(spec.num_adapters)]
    names = spec.adapter_names()
    requests, t = [], 0.0
    while True:
        if spec.num_requests is not None and len(requests) >= spec.num_requests:
            break
        if spec.rate != float("inf"):
            t += rng.gammavariate(shape, 1.0 / (shape * spec.rate))
            if spec.num_requests is None and t > spec.duration_s:
                break
        if spec.num_adapters:
            i = rng.choices(range(spec.num_adapters), weights=weights)[0]
            adapter, tenant = names[i], spec.tenant_of(i)
        else:
            adapter, tenant = None, "tenant0"
        prompt = [rng.randrange(FIRST_TOKEN_ID, spec.vocab_size) for _ in range(rng.randrange(*spec.prompt_len))]
        requests.append(BenchRequest(t if spec.rate != float("inf") else 0.0, tenant, adapter, prompt,
                                     rng.randrange(*spec.output_len)))
    return Workload(spec, requests)


def _int(value) -> int:
    """An integer, refusing floats with a fraction and booleans (int() would truncate or accept them)."""
    if isinstance(value, bool) or not float(value).is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def write_trace(workload: Workload, path: str | Path) -> None:
    """One JSON object per line: arrival_s, tenant, adapter, prompt_token_ids, output_len."""
    with open(path, "w") as f:
        for r in workload.requests:
            f.write(json.dumps(asdict(r)) + "\n")


def read_trace(path: str | Path, vocab_size: int = 49152, seed: int = 0) -> Workload:
    """Replay a JSONL trace. Each line has arrival_s (seconds from the start), output_len, and either
    prompt_token_ids or prompt_len (random ids are drawn with `seed`); tenant and adapter are optional
    (adapter null: the base model). Lines are sorted by arrival. Raises ValueError naming the bad line."""
    rng = random.Random(seed)
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError(f"a JSON object per line, got {type(row).__name__}")
                ids = row.get("prompt_token_ids")
                if ids is None:
                    ids = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(_int(row["prompt_len"]))]
                adapter = row.get("adapter")
                if adapter is not None and not isinstance(adapter, str):
                    raise TypeError(f"adapter must be a string or null, got {adapter!r}")
                req = BenchRequest(float(row["arrival_s"]), str(row.get("tenant", "tenant0")), adapter,
                                   [_int(t) for t in ids], _int(row["output_len"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace line ({exc!r}): {line.strip()[:200]}") from exc
            if not (math.isfinite(req.arrival_s) and req.arrival_s >= 0) or req.output_len < 1 or not req.prompt_token_ids:
                raise ValueError(f"{path}:{lineno}: need a finite arrival_s >= 0, output_len >= 1 and a non-empty prompt")
            if not all(0 <= t < vocab_size for t in req.prompt_token_ids):
                raise ValueError(f"{path}:{lineno}: prompt token ids must be in [0, {vocab_size})")
            requests.append(req)
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(None, requests)
