"""What a benchmark run measures: per-request timings in, throughput, latency percentiles and goodput out.

Definitions (the ones vLLM's and S-LoRA's benchmarks use; all times in seconds from the start of the run):
    TTFT    first_token_s - arrival_s          (queueing and prefill included)
    TPOT    (finish_s - first_token_s) / (num_output_tokens - 1)   (requests with >= 2 output tokens)
    E2E     finish_s - arrival_s
    goodput requests per second that finished and met the SLO (TTFT and TPOT both under their limit)
    MFU     model FLOPs per second / the machine's measured matmul peak, over the whole run (idle time
            included), with model FLOPs 2 * decoder params * (prompt + output tokens) + 2 * lm_head
            params * output tokens (the PaLM paper's 2N per token; attention and the embedding lookup
            left out, and the lm_head only where a token is sampled)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RequestRecord:
    """One finished (or failed) request as a system under test saw it."""

    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    adapter: str | None = None
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # what a system that streams text, not token ids, got back (the HTTP client)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass
class SLO:
    """The service-level objective goodput counts against (seconds)."""

    ttft_s: float = 5.0
    tpot_s: float = 0.2

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return r.ok and r.ttft_s is not None and r.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and TPOT <= {self.tpot_s * 1e3:g} ms"


@dataclass
class RunStats:
    """What the system reports about itself during a run (None where it cannot tell)."""

    num_steps: int = 0  # engine steps (PEFT: decoding steps of its static batches)
    num_batched_rows: int = 0  # sum over steps of the sequences in the step
    adapter_hits: int | None = None
    adapter_misses: int | None = None
    num_preemptions: int | None = None
    step_log: list[list[float]] = field(default_factory=list)  # vLLM: per step [s, rows with a token, firsts]
    # CPU seconds (user + system, all threads) over the timed run: the serving process's (the in-process
    # engine's, or the `loraplex serve` subprocess's) and the HTTP client's; None where not measured
    server_cpu_s: float | None = None
    client_cpu_s: float | None = None

    @property
    def mean_batch_size(self) -> float | None:
        return self.num_batched_rows / self.num_steps if self.num_steps else None

    @property
    def adapter_hit_rate(self) -> float | None:
        if self.adapter_hits is None or self.adapter_misses is None:
            return None
        total = self.adapter_hits + self.adapter_misses
        return self.adapter_hits / total if total else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class Summary:
    """The numbers of one system on one workload."""

    system: str
    num_requests: int
    num_ok: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput: float
    ttft: dict[int, float | None]
    tpot: dict[int, float | None]
    e2e: dict[int, float | None]
    stats: RunStats
    mfu: float | None = None

    def row(self, q: int, what: str) -> float | None:
        return getattr(self, what)[q]


QUANTILES = (50, 90, 99)


def summarize(system: str, records: list[RequestRecord], stats: RunStats, slo: SLO,
              flops_per_token: float | None = None, peak_flops: float | None = None,
              flops_per_output_token: float = 0.0) -> Summary:
    """Throughput counts from the first arrival to the last finish (0 when nothing finished); latencies
    over the requests that finished."""
    ok = [r for r in records if r.ok]
    first = min((r.arrival_s for r in records), default=0.0)
    duration = max((r.finish_s for r in ok), default=first) - first or float("inf")
    out_tokens = sum(r.num_output_tokens for r in ok)
    mfu = None
    if flops_per_token and peak_flops:
        tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in ok)
        outputs = sum(r.num_output_tokens for r in ok)
        mfu = (flops_per_token * tokens + flops_per_output_token * outputs) / duration / peak_flops

    def pcts(attr: str) -> dict[int, float | None]:
        values = [v for v in (getattr(r, attr) for r in ok) if v is not None]
        return {q: percentile(values, q) for q in QUANTILES}

    return Summary(system, len(records), len(ok), duration, len(ok) / duration, out_tokens / duration,
                   sum(slo.met(r) for r in records) / duration, pcts("ttft_s"), pcts("tpot_s"), pcts("e2e_s"),
                   stats, mfu)


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, seconds: float = 1.0, device: str = "cpu") -> float:
    """This machine's dense matmul rate in FLOP/s: square products of `dtype` for about `seconds`.

    The products are n x n x n, or smaller where one of those would take over seconds / 8: the size
    doubles from 256 (or n, if smaller) while one product takes under that. bf16 on a CPU without bf16
    instructions runs at about 1 GFLOP/s (an AVX2-only EPYC, PyTorch 2.13), where one 2048-cubed product
    took 16 s and every `Bench` spent half a minute here."""
    size = min(n, 256)
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        torch.mm(a, b)  # warm-up
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        if size >= n or (time.perf_counter() - start) * 8 > seconds:
            break
        size = min(n, 2 * size)
    iters, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        iters += 1
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * iters / elapsed
