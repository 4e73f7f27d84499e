"""The benchmark's workload generator, trace replay and metric definitions (no model needed)."""

from __future__ import annotations

import json
import statistics
from collections import Counter

import numpy as np
import pytest

from loraplex.bench.metrics import SLO, RequestRecord, RunStats, percentile, summarize
from loraplex.bench.workload import WorkloadSpec, generate, read_trace, write_trace


def gaps(workload) -> list[float]:
    times = [0.0] + [r.arrival_s for r in workload.requests]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_same_seed_same_workload_and_a_new_seed_differs():
    spec = WorkloadSpec(num_adapters=8, num_requests=50, rate=4.0)
    assert generate(spec).requests == generate(spec).requests
    other = generate(WorkloadSpec(num_adapters=8, num_requests=50, rate=4.0, seed=1)).requests
    assert other != generate(spec).requests


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_arrivals_have_the_asked_rate_and_burstiness(cv):
    w = generate(WorkloadSpec(num_adapters=1, num_requests=20000, rate=5.0, cv=cv, prompt_len=(1, 2),
                              output_len=(1, 2)))
    g = gaps(w)
    assert statistics.fmean(g) == pytest.approx(1 / 5.0, rel=0.05)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.1)


def test_duration_bounds_the_workload_and_lengths_stay_in_range():
    w = generate(WorkloadSpec(num_adapters=4, rate=10.0, duration_s=20.0, prompt_len=(8, 16), output_len=(3, 5)))
    assert 150 < len(w.requests) < 250  # about rate x duration = 200
    assert max(r.arrival_s for r in w.requests) <= 20.0
    assert {r.prompt_len for r in w.requests} <= set(range(8, 16))
    assert {r.output_len for r in w.requests} == {3, 4}
    assert all(100 <= t < 49152 for r in w.requests for t in r.prompt_token_ids)


def test_popularity_follows_the_power_law():
    zipf = Counter(r.adapter for r in generate(WorkloadSpec(num_adapters=4, alpha=1.0, num_requests=20000,
                                                            prompt_len=(1, 2), output_len=(1, 2))).requests)
    expected = np.array([1, 1 / 2, 1 / 3, 1 / 4]) / sum([1, 1 / 2, 1 / 3, 1 / 4])
    got = np.array([zipf[f"lora{i}"] for i in range(4)]) / 20000
    assert np.allclose(got, expected, atol=0.01)
    uniform = Counter(r.adapter for r in generate(WorkloadSpec(num_adapters=4, alpha=0.0, num_requests=20000,
                                                               prompt_len=(1, 2), output_len=(1, 2))).requests)
    assert max(uniform.values()) / min(uniform.values()) < 1.1


def test_s2_names_and_ranks_and_tenants():
    spec = WorkloadSpec(num_adapters=6, setting="S2", num_tenants=2)
    assert spec.adapter_names()[:2] == ["s2-lora0", "s2-lora1"]
    assert [spec.adapter_rank(i) for i in range(6)] == [8, 16, 32, 64, 8, 16]
    assert WorkloadSpec(rank=16).adapter_rank(3) == 16
    assert [spec.tenant_of(i) for i in range(3)] == ["tenant0", "tenant1", "tenant0"]


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(path)


@pytest.mark.parametrize("bad", [dict(duration_s=0), dict(num_requests=0), dict(rank=0), dict(rate=0), dict(cv=0), dict(prompt_len=(5, 5)), dict(output_len=(0, 3)),
                                 dict(setting="S3"), dict(num_adapters=-1), dict(rate=float("inf"))])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)


def test_infinite_rate_puts_every_arrival_at_zero():
    w = generate(WorkloadSpec(num_requests=5, rate=float("inf")))
    assert [r.arrival_s for r in w.requests] == [0.0] * 5


def test_warm_up_is_the_first_requests_at_once_reversed_with_short_outputs():
    spec = WorkloadSpec(num_adapters=4, num_requests=40, rate=2.0, output_len=(4, 60))
    w = generate(spec)
    warm = w.warm_up()
    assert len(warm) == 32
    assert [(r.tenant, r.adapter, r.prompt_token_ids[::-1]) for r in warm] == [
        (r.tenant, r.adapter, r.prompt_token_ids) for r in w.requests[:32]]
    assert {r.arrival_s for r in warm} == {0.0}
    assert [r.output_len for r in warm] == [min(8, r.output_len) for r in w.requests[:32]]
    assert any(r.output_len < 8 for r in w.requests[:32]) and any(r.output_len > 8 for r in w.requests[:32])
    assert w.requests == generate(spec).requests  # the workload itself is left as it was
    assert len(w.warm_up(num_requests=100, output_len=2)) == 40


def test_trace_round_trip_and_prompt_len_lines(tmp_path):
    w = generate(WorkloadSpec(num_adapters=3, num_requests=10, prompt_len=(2, 6), output_len=(1, 4)))
    path = tmp_path / "trace.jsonl"
    write_trace(w, path)
    assert read_trace(path).requests == w.requests
    path.write_text(json.dumps({"arrival_s": 1.5, "prompt_len": 7, "output_len": 3}) + "\n\n"
                    + json.dumps({"arrival_s": 0.5, "tenant": "t", "adapter": "a", "prompt_token_ids": [5, 6],
                                  "output_len": 2}) + "\n")
    first, second = read_trace(path).requests
    assert (first.arrival_s, first.adapter, first.prompt_token_ids) == (0.5, "a", [5, 6])
    assert (second.arrival_s, second.tenant, second.adapter, second.prompt_len) == (1.5, "tenant0", None, 7)


@pytest.mark.parametrize("line, message", [
    ('{"arrival_s": 0}', "bad trace line"),
    ("not json", "bad trace line"),
    ('{"arrival_s": -1, "prompt_len": 3, "output_len": 2}', "arrival_s >= 0"),
    ('{"arrival_s": 0, "prompt_token_ids": [], "output_len": 2}', "non-empty prompt"),
    ('{"arrival_s": NaN, "prompt_len": 3, "output_len": 2}', "finite arrival_s"),
    ('{"arrival_s": Infinity, "prompt_len": 3, "output_len": 2}', "finite arrival_s"),
    ('[1, 2]', "a JSON object per line"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 2.5}', "expected an integer"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 2, "adapter": 7}', "adapter must be a string"),
    ('{"arrival_s": 0, "prompt_token_ids": [5, 49152], "output_len": 2}', r"in \[0, 49152\)"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"t.jsonl:2: .*{message}"):
        read_trace(path)


def test_percentile_matches_numpy():
    xs = [0.3, 0.1, 0.9, 0.5, 0.7, 2.0, 0.05]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_summary_definitions():
    records = [
        RequestRecord(arrival_s=0.0, first_token_s=0.5, finish_s=1.5, num_prompt_tokens=10, num_output_tokens=11),
        RequestRecord(arrival_s=1.0, first_token_s=3.0, finish_s=4.0, num_prompt_tokens=5, num_output_tokens=2),
        RequestRecord(arrival_s=1.0, first_token_s=None, finish_s=None, num_prompt_tokens=5, num_output_tokens=0,
                      error="HTTP 500"),
    ]
    assert records[0].ttft_s == 0.5 and records[0].tpot_s == pytest.approx(0.1) and records[0].e2e_s == 1.5
    assert records[1].tpot_s == pytest.approx(1.0)
    s = summarize("x", records, RunStats(num_steps=4, num_batched_rows=10, adapter_hits=3, adapter_misses=1),
                  SLO(ttft_s=1.0, tpot_s=0.2), flops_per_token=100.0, peak_flops=1000.0)
    assert (s.num_requests, s.num_ok, s.duration_s) == (3, 2, 4.0)
    assert s.requests_per_s == pytest.approx(0.5) and s.output_tokens_per_s == pytest.approx(13 / 4)
    assert s.goodput == pytest.approx(1 / 4)  # only the first meets TTFT <= 1 s and TPOT <= 200 ms
    assert s.ttft[50] == pytest.approx(1.25) and s.e2e[99] == pytest.approx(1.5 + 0.99 * 1.5)
    assert s.stats.mean_batch_size == 2.5 and s.stats.adapter_hit_rate == 0.75
    assert s.mfu == pytest.approx(100.0 * (10 + 11 + 5 + 2) / 4.0 / 1000.0)


def test_report_names_each_systems_failed_requests_and_why():
    from types import SimpleNamespace

    from loraplex.bench.metrics import RequestRecord
    from loraplex.bench.report import failures

    done = RequestRecord(0.0, 0.1, 0.5, 4, 2)
    busy = RequestRecord(0.0, None, None, 4, 0, error="APIStatusError: 503 server busy")
    gone = RequestRecord(0.0, None, None, 4, 0, error="ReadError: connection reset")
    runs = {"engine": SimpleNamespace(records=[done, done]),
            "http": SimpleNamespace(records=[done, busy, gone, busy])}
    assert failures(runs) == ["Failed in `http`: 3 of 4 requests: 2 x `APIStatusError: 503 server busy`; "
                              "1 x `ReadError: connection reset`.", ""]
    assert failures({"engine": runs["engine"]}) == []


def test_bench_servers_queue_every_request_and_the_caller_overrides(monkeypatch, tmp_path):
    """Every bench server lifts the gateway's 10 s queue-wait bound (so it serves what the in-process
    engine serves), the caller's own LORAPLEX_* settings stay out, and engine_env wins."""
    from loraplex.bench.http_client import server_environ
    from loraplex.platform.config import Settings
    from loraplex.platform.security import new_key

    key = new_key()
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://elsewhere:6379")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    env = server_environ({"LORAPLEX_DTYPE": "float32"}, home=tmp_path, port=8123, admin_key=key)
    assert "LORAPLEX_REDIS_URL" not in env and env["OMP_WAIT_POLICY"] == "passive"
    assert env["LORAPLEX_DTYPE"] == "float32" and env["LORAPLEX_PORT"] == "8123"
    assert env["LORAPLEX_HOME"] == str(tmp_path) and env["LORAPLEX_ADMIN_KEY"] == key
    for name in [k for k in env if k.startswith("LORAPLEX_")]:
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv("LORAPLEX_REDIS_URL")
    assert Settings().max_queue_wait_s == 3600.0  # the server reads it
    assert server_environ({"LORAPLEX_MAX_QUEUE_WAIT_S": "5"}, home=tmp_path, port=1,
                          admin_key=key)["LORAPLEX_MAX_QUEUE_WAIT_S"] == "5"


def test_http_pairs_table_gives_each_pairs_ratios_and_their_medians():
    """Pairs of runs (an engine and an http run, in either order): each pair's HTTP / in-process throughput
    and TTFT p50, with the CPU seconds each side used, and the medians over the pairs that made tokens."""
    from types import SimpleNamespace

    from loraplex.bench.report import http_pairs_table

    def run(system: str, tokens: int, ttft: float, server_cpu: float, client_cpu: float | None = None):
        # one request arriving at 0, first token at ttft, done at 10 s: tokens / 10 tok/s
        rec = RequestRecord(arrival_s=0.0, first_token_s=ttft, finish_s=10.0, num_prompt_tokens=4,
                            num_output_tokens=tokens)
        stats = RunStats(server_cpu_s=server_cpu, client_cpu_s=client_cpu)
        return SimpleNamespace(system=system, summary=summarize(system, [rec], stats, SLO()))

    failed = SimpleNamespace(system="http", summary=summarize(
        "http", [RequestRecord(0.0, None, None, 4, 0, error="ReadError")], RunStats(), SLO()))
    pairs = [run("engine", 100, 0.2, 9.0), run("http", 90, 0.3, 9.5, 0.5),   # 0.90x, TTFT 1.50x
             run("http", 80, 0.5, 9.9, 0.7), run("engine", 100, 0.2, 9.0),   # HTTP first: 0.80x, 2.50x
             run("engine", 100, 0.4, 9.0), run("http", 100, 0.4, 9.1, 0.4),  # 1.00x, 1.00x
             run("engine", 100, 0.4, 9.0), failed]                            # 0.00x, no TTFT
    lines = http_pairs_table(pairs)
    assert lines[2] == "| 1 (in-process first) | 10.0 | 9.00 | 9.0 | 9.50 | 0.50 | 0.90x | 1.50x |"
    assert lines[3] == "| 2 (HTTP first) | 10.0 | 9.00 | 8.0 | 9.90 | 0.70 | 0.80x | 2.50x |"
    assert lines[5] == "| 4 (in-process first) | 10.0 | 9.00 | 0.0 | – | – | 0.00x | – |"
    assert lines[-1] == "| median | | | | | | **0.85x** | **1.50x** |"
    assert http_pairs_table([]) == lines[:2]


def test_peer_pairs_table_gives_each_pairs_ratios_agreement_and_their_medians():
    """Base-only pairs with vLLM (a base and a vllm-base run, in either order): each pair's tok/s, ours /
    vLLM's throughput, TTFT p50 and TPOT p50, the greedy agreement of the two runs, and the medians over
    the pairs where both runs made tokens."""
    from types import SimpleNamespace

    from loraplex.bench.report import peer_pairs_table

    def run(system: str, tokens: int, ttft: float, ids: list[list[int]]):
        # len(ids) requests arriving at 0, first token at ttft, done at 10 s, `tokens` output tokens each
        recs = [RequestRecord(arrival_s=0.0, first_token_s=ttft, finish_s=10.0, num_prompt_tokens=4,
                              num_output_tokens=tokens, token_ids=t) for t in ids]
        return SimpleNamespace(system=system, records=recs, summary=summarize(system, recs, RunStats(), SLO()))

    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    failed = SimpleNamespace(system="vllm-base", records=[RequestRecord(0.0, None, None, 4, 0, error="died")] * 2,
                             summary=summarize("vllm-base", [RequestRecord(0.0, None, None, 4, 0, error="died")],
                                               RunStats(), SLO()))
    pairs = [run("base", 120, 0.2, same), run("vllm-base", 100, 0.3, same),    # 1.20x, TTFT 0.67x, 2 of 2
             run("vllm-base", 100, 0.2, other), run("base", 110, 0.2, same),   # vLLM first: 1.10x, 1.00x, 1 of 2
             run("base", 130, 0.1, same), run("vllm-base", 100, 0.2, same),   # 1.30x, 0.50x
             run("base", 130, 0.1, same), failed]                             # vLLM made nothing: no ratio
    lines = peer_pairs_table(pairs)
    # TPOT: (10 - ttft) / (tokens - 1) s per token for every request of a run
    assert lines[2] == "| 1 (loraplex first) | 24.0 | 20.0 | 1.20x | 0.67x | 0.84x | 2 of 2 |"
    assert lines[3] == "| 2 (vLLM first) | 22.0 | 20.0 | 1.10x | 1.00x | 0.91x | 1 of 2 |"
    assert lines[4] == "| 3 (loraplex first) | 26.0 | 20.0 | 1.30x | 0.50x | 0.78x | 2 of 2 |"
    assert lines[5] == "| 4 (loraplex first) | 26.0 | 0.0 | – | – | – | 0 of 2 |"
    assert lines[6] == "| median | | | **1.20x** | **0.67x** | **0.84x** | |" and len(lines) == 7
    assert peer_pairs_table(pairs[:4])[-1] == "| median | | | **1.15x** | **0.83x** | **0.87x** | |"
    assert peer_pairs_table(pairs[:5]) == peer_pairs_table(pairs[:4])  # a run without its pair is left out
    assert peer_pairs_table([]) == lines[:2]
