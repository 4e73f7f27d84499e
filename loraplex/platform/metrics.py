"""Prometheus metrics (prometheus-client), on a registry of the app's own (several apps per process in
tests). Engine gauges come from a snapshot taken on the engine thread at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class EngineCollector:
    """Emits the last engine snapshot (see `engine.engine_stats`)."""

    def __init__(self):
        self.snapshot: dict | None = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        for name, doc, value in (
            ("loraplex_num_requests_running", "Requests in the running batch (batch size)", s["num_running"]),
            ("loraplex_num_requests_waiting", "Requests waiting for admission (queue depth)", s["num_waiting"]),
            ("loraplex_kv_cache_usage", "Fraction of KV cache blocks in use", s["kv_cache_usage"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        tiers = s["adapters"]["tiers"]
        resident = GaugeMetricFamily("loraplex_adapters_resident", "Adapters held per tier (slots, cpu, disk)",
                                     labels=["tier"])
        for tier, t in tiers.items():
            resident.add_metric([tier], t.get("adapters", t["used"]))
        yield resident
        for key, doc in (("hits", "Adapter hits per tier"), ("misses", "Adapter misses per tier"),
                         ("evictions", "Adapter evictions per tier")):
            family = CounterMetricFamily(f"loraplex_adapter_{key}", doc, labels=["tier"])
            for tier, t in tiers.items():
                if key in t:
                    family.add_metric([tier], t[key])
            yield family
        loads = CounterMetricFamily("loraplex_adapter_loads", "Adapter loads into a tier (one per miss)",
                                    labels=["tier"])
        for tier, t in tiers.items():
            if "misses" in t:
                loads.add_metric([tier], t["misses"])
        yield loads
        yield CounterMetricFamily("loraplex_engine_steps", "Engine steps", value=s["num_steps"])
        cache = s.get("prefix_cache")
        if cache is not None:  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
            yield CounterMetricFamily("loraplex_prefix_cache_queries", "Tokens of the requests admitted, looked up "
                                      "in the prefix cache", value=cache["num_query_tokens"])
            yield CounterMetricFamily("loraplex_prefix_cache_hits", "Tokens found in the prefix cache (their KV "
                                      "blocks reused, not computed)", value=cache["num_hit_tokens"])
            yield CounterMetricFamily("loraplex_prefix_cache_evictions", "Cached KV blocks taken for other "
                                      "tokens", value=cache["num_evicted_blocks"])
            yield GaugeMetricFamily("loraplex_prefix_cache_blocks", "KV cache blocks held by the prefix cache "
                                    "(in use or evictable)", value=cache["num_cached_blocks"])
        yield from tenant_families(s.get("tenants", {}))


def tenant_families(tenants: dict):
    """Per tenant id (the engine knows ids; "none" is requests without a tenant): queue depth, running
    requests, tokens computed by kind, and the fair-share counter (weighted tokens over weight)."""
    waiting = GaugeMetricFamily("loraplex_tenant_requests_waiting", "Requests waiting for admission, per tenant",
                                labels=["tenant_id"])
    running = GaugeMetricFamily("loraplex_tenant_requests_running", "Requests in the running batch, per tenant",
                                labels=["tenant_id"])
    tokens = CounterMetricFamily("loraplex_tenant_tokens_computed", "Tokens the engine computed per tenant, by kind "
                                 "(prompt: prefill, recompute included; output: sampled)", labels=["tenant_id", "kind"])
    counter = GaugeMetricFamily("loraplex_tenant_fair_share_counter", "Virtual token counter of the fair policy "
                                "(weighted tokens over weight, since the tenant's last return)", labels=["tenant_id"])
    for key, t in tenants.items():
        label = ["none" if key is None else str(key)]
        waiting.add_metric(label, t["num_waiting"])
        running.add_metric(label, t["num_running"])
        tokens.add_metric([*label, "prompt"], t["num_prompt_tokens"])
        tokens.add_metric([*label, "output"], t["num_output_tokens"])
        if t["counter"] is not None:
            counter.add_metric(label, t["counter"])
    yield from (waiting, running, tokens, counter)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("loraplex_requests", "API requests by tenant, endpoint and status",
                                ["tenant", "endpoint", "status"], registry=self.registry)
        self.tokens = Counter("loraplex_tokens", "Tokens by tenant and kind (prompt, completion)",
                              ["tenant", "kind"], registry=self.registry)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("loraplex_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.latency = Histogram("loraplex_request_latency_seconds", "Engine latency of a request",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.shed = Counter("loraplex_requests_shed", "Requests refused with 503 by design before anything ran, by "
                            "reason (engine_queue_full, shutting_down)", ["reason"], registry=self.registry)
        self.engine = EngineCollector()
        self.registry.register(self.engine)

    def observe_request(self, tenant: str, endpoint: str, status: str) -> None:
        self.requests.labels(tenant, endpoint, status).inc()

    def observe_shed(self, reason: str) -> None:
        self.shed.labels(reason).inc()

    def observe_generation(self, tenant: str, num_prompt_tokens: int, num_completion_tokens: int,
                           ttft_s: float | None, latency_s: float | None) -> None:
        self.tokens.labels(tenant, "prompt").inc(num_prompt_tokens)
        self.tokens.labels(tenant, "completion").inc(num_completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if latency_s is not None:
            self.latency.observe(latency_s)
            if ttft_s is not None and num_completion_tokens > 1:
                self.tpot.observe((latency_s - ttft_s) / (num_completion_tokens - 1))

    def render(self, engine_snapshot: dict) -> bytes:
        self.engine.snapshot = engine_snapshot
        return generate_latest(self.registry)
