"""`loraplex bench` end to end on the real default model, with a workload small enough for a test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loraplex.bench import report
from loraplex.bench.metrics import SLO, RequestRecord, RunStats, summarize
from loraplex.bench.run import PRESETS, Bench, Preset
from loraplex.bench.workload import BenchRequest, Workload, WorkloadSpec, read_trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory, model_path):
    main = WorkloadSpec(num_adapters=3, rate=20.0, duration_s=0.6, prompt_len=(4, 16), output_len=(2, 8),
                        num_tenants=2)
    preset = Preset(dtype="float32", main=main, systems=("engine", "static", "peft", "base"), rates=(10.0,),
                    num_adapters=(1, 4), alphas=(1.0,), alpha_num_adapters=4, num_files=2, max_loras=4, peft_batch_size=4)
    b = Bench(preset, tmp_path_factory.mktemp("adapters"))
    b.run()
    return b


def test_every_system_finishes_every_request_with_the_asked_length(bench):
    groups = [(e.group, e.system) for e in bench.results]
    assert groups == [("main", s) for s in ("engine", "static", "peft", "base")] + [
        ("rate", "engine"), ("rate", "static"), ("rate", "base"), ("adapters", "engine"), ("adapters", "engine"),
        ("alpha", "engine"), ("alpha", "engine")]
    main = [e for e in bench.results if e.group == "main"]
    expected = [r.output_len for r in bench.main_workload.requests]
    for e in main:
        assert [r.num_output_tokens for r in e.records] == expected, e.system
        assert all(r.ok and r.arrival_s <= r.first_token_s <= r.finish_s for r in e.records), e.system
        assert e.summary.num_ok == len(expected)


def test_same_prompts_give_the_same_greedy_tokens_in_every_system(bench):
    """fp32: continuous, static and PEFT's mixed-adapter generate agree token for token."""
    engine, static, peft, base = (e.records for e in bench.results[:4])
    assert [r.token_ids for r in engine] == [r.token_ids for r in peft]
    assert [r.token_ids for r in engine] == [r.token_ids for r in static]
    assert [r.adapter for r in engine] != [None] * len(engine) and all(r.adapter is None for r in base)
    assert [r.token_ids for r in engine] != [r.token_ids for r in base]  # the adapters change the output


def test_adapters_sweep_pages_through_slots_and_s2_registers_mixed_ranks(bench):
    sweep = [e for e in bench.results if e.group == "adapters"]
    assert [e.spec.num_adapters for e in sweep] == [1, 4]
    assert all(0 < e.summary.stats.adapter_hit_rate <= 1 for e in sweep)
    ranks = {json.loads((bench.adapter_dirs[f"s2-lora{i}"] / "adapter_config.json").read_text())["r"]
             for i in range(4)}
    assert ranks == {8, 16, 32, 64}


def test_report_has_the_tables_ratios_and_plots(bench, tmp_path):
    out = tmp_path / "tiny.md"
    report.write(out, bench, command="loraplex bench --preset tiny", elapsed_s=12.0)
    text = out.read_text()
    for heading in ("## Side by side", "## Rate sweep", "## Number of adapters", "## Popularity and ranks"):
        assert heading in text
    for comparison in ("continuous vs static batching", "engine vs transformers + PEFT", "multi-adapter vs base-only"):
        assert re.search(rf"\| {re.escape(comparison)} \| \d+\.\d\dx \| \d+\.\d\dx \| \d+\.\d\dx \| \d+\.\d\dx \| \d+\.\d\dx \|",
                         text), comparison
    n = len(bench.results[0].records)
    assert f"token for token: {n} of {n} requests" in text
    assert "command: `loraplex bench --preset tiny`" in text
    assert "max_num_seqs 64, max_num_batched_tokens 512 (every engine's)" in text
    # no HTTP system in this preset: one tenant in-process, as PEFT's batches have none
    assert "In-process, our engine queues every request under one tenant (first come, first served)." in text
    assert re.search(r"float32 \d+ GFLOP/s, bfloat16 \d+ GFLOP/s; MFU = .* the float32 peak", text)
    for png in ("throughput_vs_rate", "ttft_p99_vs_rate", "throughput_vs_adapters"):
        data = (tmp_path / "tiny" / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"(tiny/{png}.png)" in text


def test_dummy_weights_skip_peft_and_http_and_draw_prompts_below_the_vocabulary(tmp_path):
    """The GPU preset's path (random weights, no tokenizer), at tiny shapes on the CPU."""
    main = WorkloadSpec(num_adapters=2, rate=50.0, duration_s=0.2, prompt_len=(4, 8), output_len=(2, 4))
    preset = Preset(model="tiny-llama", load_format="dummy", dtype="float32", main=main, rates=(), num_adapters=(),
                    alphas=(), max_loras=2)
    b = Bench(preset, tmp_path)
    b.run()
    assert [e.system for e in b.results] == ["engine", "static", "base"]
    assert all(t < 512 for r in b.main_workload.requests for t in r.prompt_token_ids)
    assert all(r.ok for e in b.results for r in e.records)
    report.write(tmp_path / "gpu.md", b, command="x", elapsed_s=1.0)
    text = (tmp_path / "gpu.md").read_text()
    assert "multi-adapter vs base-only" in text and "engine vs transformers + PEFT" not in text


def test_vllm_systems_are_skipped_with_a_clear_line_when_the_peer_is_not_installed(tmp_path, monkeypatch):
    """The suite never needs vLLM: without a peer the vllm systems are left out and the report says why."""
    from loraplex.bench.systems import peer_python

    monkeypatch.delenv("LORAPLEX_PEER_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .peer/vllm here
    assert peer_python(None) is None and peer_python(str(tmp_path / "missing")) is None
    default = tmp_path / ".peer/vllm/bin/python"
    default.parent.mkdir(parents=True)
    default.write_text("")
    assert peer_python(None) == Path(".peer/vllm/bin/python")
    assert peer_python(str(tmp_path / "missing")) is None  # a wrong --peer-python never falls back to it
    default.unlink()
    main = WorkloadSpec(num_adapters=2, rate=50.0, duration_s=0.2, prompt_len=(4, 8), output_len=(2, 4))
    preset = Preset(dtype="float32", main=main, rates=(), num_adapters=(), alphas=(), max_loras=2,
                    systems=("engine", "vllm", "vllm-base"))
    b = Bench(preset, tmp_path, peer_python=None)
    b.run()
    assert [e.system for e in b.results] == ["engine"]
    report.write(tmp_path / "vllm.md", b, command="x", elapsed_s=1.0)
    text = (tmp_path / "vllm.md").read_text()
    for system in ("vllm", "vllm-base"):
        assert (f"Skipped: {system}: vLLM is not installed (run `scripts/peer-vllm`, or pass --peer-python / set "
                "LORAPLEX_PEER_PYTHON).") in text


def test_cli_help_lists_the_presets():
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "{adapter-paging,adapter-paging-all,engine-throughput,fairness,full,gpu-s1,prefix-cache,scale-out,small,structured,vllm}" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "loraplex.cli", "bench", "--preset", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr


def test_trace_replay_registers_the_traces_own_adapter_names(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 0.0, "tenant": "acme", "adapter": "support-bot", "prompt_len": 5, "output_len": 3},
            {"arrival_s": 0.05, "tenant": "zeta", "adapter": "lora12", "prompt_token_ids": [7, 8, 9], "output_len": 2},
            {"arrival_s": 0.1, "tenant": "acme", "adapter": None, "prompt_len": 4, "output_len": 2}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = Preset(model="tiny-llama", load_format="dummy", dtype="float32", systems=("engine", "base"), rates=(),
                    num_adapters=(), alphas=(), max_loras=2)
    b = Bench(preset, tmp_path / "adapters")
    b.run(read_trace(trace, vocab_size=512))
    assert sorted(b.adapter_dirs) == ["lora12", "support-bot"]
    engine = b.results[0]
    assert [r.num_output_tokens for r in engine.records] == [3, 2, 2] and all(r.ok for r in engine.records)
    assert [r.adapter for r in engine.records] == ["support-bot", "lora12", None]


def test_a_refused_request_is_that_requests_failure_not_the_runs(tmp_path):
    from loraplex import LLM
    from loraplex.bench.systems import run_engine

    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", num_kv_blocks=4, block_size=16)
    work = Workload(None, [BenchRequest(0.0, "t", None, [5] * 10, 4), BenchRequest(0.0, "t", None, [5] * 70, 4),
                           BenchRequest(0.01, "t", "no-such-adapter", [5] * 3, 2)])
    records, _ = run_engine(llm, work)
    assert records[0].ok and records[0].num_output_tokens == 4
    assert "needs 74 tokens of KV cache" in records[1].error and not records[1].ok
    assert "is not loaded" in records[2].error
    s = summarize("engine", records, RunStats(), SLO())
    assert (s.num_ok, s.num_requests) == (1, 3)
    nothing = summarize("engine", records[1:], RunStats(), SLO())
    assert nothing.requests_per_s == 0 and nothing.output_tokens_per_s == 0 and nothing.ttft[50] is None


def test_a_presets_prefill_budget_and_tenants_reach_every_engine(tmp_path, monkeypatch):
    # the vllm preset gives both engines vLLM-CPU's default budget for its offline LLM (4096 tokens a step)
    assert PRESETS["vllm"]().max_num_batched_tokens == 4096 and PRESETS["small"]().max_num_batched_tokens is None
    # in-process tenants where the preset runs the HTTP server (whose engine sees the callers' tenants)
    assert [PRESETS[p]().in_process_tenants for p in ("small", "vllm", "engine-throughput")] == [True, False, False]
    preset = Preset(model="tiny-llama", load_format="dummy", dtype="float32", systems=("engine", "http"), rates=(),
                    num_adapters=(), alphas=(), max_num_seqs=4, max_num_batched_tokens=16)
    b = Bench(preset, tmp_path / "adapters")
    assert b.llm.engine.config.max_num_batched_tokens == 16
    import loraplex.bench.http_client as http_client

    seen = {}

    def fake_run_http(workload, dirs, *, engine_env, log_path):  # the server's settings, not a server
        seen.update(engine_env)
        return [RequestRecord(r.arrival_s, None, None, r.prompt_len, 0, error="not run") for r in workload.requests], RunStats()

    monkeypatch.setattr(http_client, "run_http", fake_run_http)
    b.measure("main", None, "http", Workload(None, [BenchRequest(0.0, "t", None, [5] * 4, 2)]))
    assert seen["LORAPLEX_MAX_NUM_BATCHED_TOKENS"] == "16" and seen["LORAPLEX_MAX_NUM_SEQS"] == "4"
    from loraplex.bench.systems import run_engine

    steps = b.llm.engine.num_steps
    records, _ = run_engine(b.llm, Workload(None, [BenchRequest(0.0, "t", None, [5] * 40, 2)]))
    # 40 prompt tokens in chunks of at most 16: the first token in the third step, the second in the fourth
    assert records[0].ok and records[0].num_output_tokens == 2 and b.llm.engine.num_steps - steps == 4


@pytest.mark.parametrize("tenants, expected", [
    # tenants numbered in name order, as the bench's HTTP server creates them; each counter is VTC's service
    # (1 per prompt token, 2 per output token, weight 1)
    (True, {1: (6 + 3) + 2 * (2 + 3), 2: 10 + 2 * 4}),
    (False, {None: (6 + 3 + 10) + 2 * (2 + 3 + 4)}),
])
def test_in_process_runs_queue_each_request_under_its_tenant(tenants, expected):
    from loraplex import LLM
    from loraplex.bench.systems import run_engine

    llm = LLM("tiny-llama", load_format="dummy", dtype="float32")
    work = Workload(None, [BenchRequest(0.0, "b", None, [5] * 10, 4), BenchRequest(0.0, "a", None, [6] * 6, 2),
                           BenchRequest(0.0, "a", None, [7] * 3, 3)])
    records, _ = run_engine(llm, work, tenants=tenants)
    assert [r.num_output_tokens for r in records] == [4, 2, 3] and all(r.ok for r in records)
    shares = llm.engine.scheduler.fair.tenant_stats()
    assert {k: v["counter"] for k, v in shares.items()} == expected
    assert all(v["num_requests"] == 0 for v in shares.values())


@pytest.mark.parametrize("args, message", [
    (["--systems", "engine,sglang"], "unknown systems ['sglang']"),
    (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
    (["--http-pairs", "-1"], "--http-pairs must be >= 0, got -1"),
    (["--preset", "vllm", "--peer-pairs", "-2"], "--peer-pairs must be >= 0, got -2"),
])
def test_cli_refuses_bad_arguments_before_loading_the_model(args, message):
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "bench", *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_offline_all_at_once_workload_on_seven_projections_with_cold_loads(tmp_path):
    """The shape of the engine-throughput and adapter-paging presets (every request at time 0, adapters on
    all seven projections, the cold-load table), at tiny shapes."""
    from loraplex.bench.run import ALL_LINEAR

    main = WorkloadSpec(num_adapters=3, rate=float("inf"), num_requests=6, prompt_len=(4, 8), output_len=(2, 4),
                        setting="S2")
    preset = Preset(model="tiny-llama", load_format="dummy", dtype="float32", main=main, systems=("engine", "base"),
                    rates=(), num_adapters=(1, 3), alphas=(), max_loras=2, targets=ALL_LINEAR, cold_load_ranks=(8, 16))
    b = Bench(preset, tmp_path)
    b.run()
    assert all(r.arrival_s == 0.0 for r in b.main_workload.requests)
    assert [(e.group, e.system) for e in b.results] == [("main", "engine"), ("main", "base"), ("adapters", "engine"),
                                                          ("adapters", "engine")]
    assert all(r.ok for e in b.results for r in e.records)
    assert [r for r, *_ in b.cold_loads] == [8, 16] and all(t > 0 for _, *ts in b.cold_loads for t in ts)
    mgr = b.llm.engine.adapters
    assert "cold-r8" not in mgr and all(len(mgr.host[n].stacked) == 7 for n in mgr.host.entries)
    report.write(tmp_path / "offline.md", b, command="x", elapsed_s=1.0)
    text = (tmp_path / "offline.md").read_text()
    assert "6 requests all at time 0" in text and "on q/k/v/o/gate/up/down" in text
    assert re.search(r"\| 16 \| \d+\.\d \| \d+\.\d \| \d+\.\d \|", text)


def test_cli_main_only_runs_the_main_workload_without_the_sweeps(tmp_path):
    """`--main-only`: the side-by-side table and nothing from the rate, adapter-count or alpha sweeps (the
    small preset has all three)."""
    out = tmp_path / "small.md"
    run = subprocess.run([sys.executable, "-m", "loraplex.cli", "bench", "--preset", "small", "--model", "tiny-llama",
                          "--load-format", "dummy", "--systems", "engine", "--main-only", "--threads", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    measured = [line.split()[0] for line in run.stdout.splitlines() if line.startswith("  ")]
    assert measured == ["main"], run.stdout
    text = out.read_text()
    assert "## Side by side" in text and "| loraplex, continuous batching | 99/99 |" in text
    assert "## Rate sweep" not in text and "--main-only" in text


def test_a_repeated_run_is_recorded_but_other_tables_reuse_the_first(bench):
    """`measure(reuse=False)` (the in-process/HTTP pairs) runs a (system, spec) again; a later table that
    asks for that measurement gets the first run, not the repeat."""
    from loraplex.bench.workload import generate

    spec = bench.preset.main
    first = next(e.summary for e in bench.results if e.group == "main" and e.system == "engine")
    n = len(bench.results)
    try:
        again = bench.measure("pairs", spec, "engine", generate(spec), reuse=False)
        assert again is not first and bench.results[-1].group == "pairs" and bench.results[-1].summary is again
        assert bench.measure("later", spec, "engine", generate(spec)) is first
    finally:
        del bench.results[n:]


def test_pairs_alternate_which_system_runs_first_and_never_stand_in_for_the_first_run():
    """`Bench.measure_pairs`: n pairs, a first in even pairs and b first in odd ones, each a repeat
    (reuse=False), under the pairs' group; the vllm preset asks for four base-only pairs with vLLM (each
    engine first in two) and, where they cannot run, says why."""
    from types import SimpleNamespace

    from loraplex.bench.run import PRESETS

    calls = []
    fake = SimpleNamespace(measure=lambda group, spec, system, work, *, reuse: calls.append((group, system, reuse)))
    Bench.measure_pairs(fake, "peer-pairs", None, ("base", "vllm-base"), 3, None)
    assert calls == [("peer-pairs", "base", False), ("peer-pairs", "vllm-base", False),
                     ("peer-pairs", "vllm-base", False), ("peer-pairs", "base", False),
                     ("peer-pairs", "base", False), ("peer-pairs", "vllm-base", False)]
    assert PRESETS["vllm"]().peer_pairs == 4 and PRESETS["small"]().peer_pairs == 0

    def run(preset, peer_python) -> tuple[list[str], list[str]]:
        """Bench.run on a stand-in bench: the groups it measured (pairs by their group) and what it skipped."""
        measured, skipped = [], []
        fake = SimpleNamespace(preset=preset, peer_python=peer_python, skipped=skipped,
                               measure=lambda group, spec, system, work, **kw: measured.append(group),
                               measure_pairs=lambda group, *a: measured.append(group))
        Bench.run(fake, trace=SimpleNamespace(requests=[], num_output_tokens=0))
        return measured, skipped

    vllm = PRESETS["vllm"]()
    assert run(vllm, "/peer/python") == (["main"] * 4 + ["peer-pairs"], [])
    for preset, peer, why in [
            (replace(vllm, systems=("base", "vllm-base")), None, "vLLM is not installed"),
            (replace(vllm, systems=("engine", "vllm")), "/peer/python", "they need the base and vllm-base systems"),
            (replace(vllm, load_format="dummy"), "/peer/python", "they need the model's files (not --load-format dummy)")]:
        measured, skipped = run(preset, peer)
        assert "peer-pairs" not in measured and skipped == [f"the base-only pairs with vLLM: {why}"]
