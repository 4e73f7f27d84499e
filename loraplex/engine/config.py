"""Engine configuration: `EngineConfig` holds the engine's limits and checks itself in `__post_init__`.
The model's shape (`ModelConfig`) is in `loraplex/model_config.py`, below the engine and the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fair", "fcfs")
PREFIX_CACHE_SCOPES = ("tenant", "global")


@dataclass
class EngineConfig:
    """Limits of one engine.

    max_num_seqs: running requests in one step. max_num_batched_tokens: tokens (prefill chunks plus
    decodes) in one forward pass. kv_cache_memory: bytes for the paged KV cache; None takes
    `default_kv_cache_memory` (a quarter of the weights' size, at least 64 MiB). block_size: tokens per
    KV cache block. max_loras: adapter slots of max_lora_rank rank rows each (vLLM's `max_loras` memory:
    max_loras x max_lora_rank rank rows per projection), paged in `LORA_PAGE_ROWS`-row pages, so one step
    holds max_loras adapters of rank max_lora_rank, or up to max_loras x max_lora_rank / 8 of rank 8
    (when 8 divides max_lora_rank; otherwise a page is a whole slot).
    max_lora_rank: the largest rank `r` an adapter may have. max_cpu_loras: adapters kept in host memory
    (None: no limit). num_threads: PyTorch's CPU threads for the engine (None: the CPUs this process may
    use, `loraplex.threads.usable_cpus`); ignored on a GPU.
    max_num_waiting_seqs / max_num_waiting_tokens: how many requests beyond the running batch's free
    places, and how many tokens still to be prefilled, the waiting queue takes from a server (`AsyncLLM`)
    before it sheds new ones with `EngineOverloadedError` (`Scheduler.has_room`); None derives them: one
    more batch of requests (max_num_seqs) and 32 steps of prefill (32 x max_num_batched_tokens).
    max_queue_wait_s: the server also sheds a call whose last request would wait longer than this for a
    place in the batch, estimated from the running requests' remaining tokens and the recent step time
    (None: no bound in time). An empty queue always takes a call, however large. The offline `LLM`
    queues everything it is given.
    scheduling_policy: "fair" (the default: priority, then fair share across tenants by Virtual Token
    Counter, with preemption for either; `loraplex.engine.fair_share`) or "fcfs" (arrival order; priority
    is ignored). priority_aging_s: under "fair", a waiting request's priority moves one level toward the
    most urgent one per this many seconds since it arrived (None: no aging, low priority may starve).
    enable_prefix_caching: keep full KV blocks after their requests end and reuse them for a later
    prompt that starts with the same tokens under the same weights (`loraplex.engine.block_manager`);
    on by default, as in vLLM. Off for benchmarks that measure raw prefill. prefix_cache_scope: "tenant"
    (the default: blocks are shared only among one tenant's requests, so no tenant can tell from its
    cached tokens or latency what another sent) or "global" (shared across tenants).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests)
    max_num_waiting_seqs: int | None = None
    max_num_waiting_tokens: int | None = None
    max_queue_wait_s: float | None = 10.0
    static_batching: bool = False  # benchmark baseline: admit a new batch only when the last one is done
    seed: int = 0
    num_threads: int | None = None
    scheduling_policy: str = "fair"
    priority_aging_s: float | None = 10.0
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "tenant"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}), or running requests can starve of decode tokens")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_waiting_seqs is None:
            self.max_num_waiting_seqs = self.max_num_seqs
        if self.max_num_waiting_tokens is None:
            self.max_num_waiting_tokens = 32 * self.max_num_batched_tokens
        for name in ("max_num_waiting_seqs", "max_num_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0 seconds or None, got {self.max_queue_wait_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.priority_aging_s is not None and not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0 seconds or None, got {self.priority_aging_s}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got "
                             f"{self.prefix_cache_scope!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
